"""Data: Search-R1 / verl parquet, a synthetic knowledge base, an offline tokenizer and tiny models."""
