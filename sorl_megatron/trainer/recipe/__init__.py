"""The recipe: its schema, loader, checks at schema / launch / inputs / run-settings time, and the memory plan."""
