import asyncio
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from sorl_megatron.data import DataError, encode_prompt, make_row, read_parquet, write_parquet
from sorl_megatron.data.gold import cold_start_plans, gold_plan, gold_trajectory
from sorl_megatron.data.synthetic import corpus, main, make_kb, questions, split_rows
from sorl_megatron.data.tokenizer import ACTION_TAGS, train_tokenizer
from sorl_megatron.retrieval import BM25Index, read_corpus
from sorl_megatron.rewards import RewardRegistry
from sorl_megatron.rollout.agent import AgentConfig, SearchAgent


def test_parquet_roundtrip(tmp_path):
    rows = [make_row("Who?", ["A", "a1"], "nq", "train", 0), make_row("Where?", ["B"], "hotpotqa", "train", 1)]
    path = write_parquet(rows, tmp_path / "x.parquet")
    back = read_parquet(path)
    assert [r.targets for r in back] == [["A", "a1"], ["B"]]
    assert back[1].data_source == "hotpotqa" and back[0].prompt[0]["role"] == "user"
    assert "Question: Where?" in back[1].prompt[0]["content"] and back[1].extra_info["index"] == 1
    schema = pq.read_schema(path)
    assert {"data_source", "prompt", "ability", "reward_model", "extra_info"} <= set(schema.names)


def test_reads_search_r1_file_as_is(tmp_path):
    table = pa.Table.from_pylist(
        [
            {
                "id": "train_0",
                "question": "who sings x",
                "golden_answers": ["Y"],
                "data_source": "nq",
                "prompt": [{"role": "user", "content": "Answer ... Question: who sings x?\n"}],
                "ability": "fact-reasoning",
                "reward_model": {"style": "rule", "ground_truth": {"target": ["Y", "Y band"]}},
                "extra_info": {"split": "train", "index": 0},
            }
        ]
    )
    pq.write_table(table, tmp_path / "train.parquet")
    (row,) = read_parquet(tmp_path / "train.parquet")
    assert row.targets == ["Y", "Y band"] and row.data_source == "nq"


def test_bad_files_name_row_and_column(tmp_path):
    pq.write_table(
        pa.Table.from_pylist([{"data_source": "nq", "prompt": [{"role": "user", "content": "q"}]}]),
        tmp_path / "a.parquet",
    )
    with pytest.raises(ValueError, match=r"a.parquet: missing column\(s\) \['reward_model'\]"):
        read_parquet(tmp_path / "a.parquet")
    bad = [
        {
            "data_source": "nq",
            "prompt": [{"role": "user", "content": "q"}],
            "reward_model": {"style": "rule", "ground_truth": {"target": ["x"]}},
        },
        {
            "data_source": "nq",
            "prompt": [{"role": "user", "content": "q"}],
            "reward_model": {"style": "rule", "ground_truth": {"target": []}},
        },
    ]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"1 bad row\(s\) of 2 in .*b.parquet:\n.*b.parquet:1: the ground-truth target"):
        read_parquet(tmp_path / "b.parquet")


def _record(**change):
    rec = {
        "data_source": "nq",
        "prompt": [{"role": "user", "content": "Question: who?"}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": ["Y"]}},
        "extra_info": {"split": "train", "index": 0},
    }
    return {**rec, **change}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"reward_model": {"style": "rule", "ground_truth": {"target": [""]}}}, r"target\[0\] is empty"),
        ({"reward_model": {"style": "rule", "ground_truth": {"target": ["Y", "  "]}}}, r"target\[1\] is empty"),
        ({"reward_model": {"style": "rule", "ground_truth": {"target": ["Y", None]}}}, r"target\[1\] must be a string"),
        # (beside rows with a target, parquet stores a row without one as a null target)
        ({"reward_model": {"style": "rule", "ground_truth": {"answers": ["Y"]}}}, r"target must be .* got None"),
        ({"reward_model": None}, r"'reward_model' must be a mapping"),
        ({"prompt": [{"role": "user", "content": ""}]}, r"prompt\[0\].content must be a non-empty string, got ''"),
        ({"prompt": [{"role": "user", "content": None}]}, r"prompt\[0\].content must be a non-empty string, got None"),
        ({"prompt": []}, r"column 'prompt' must be a non-empty list"),
        ({"prompt": None}, r"column 'prompt' must be a non-empty list"),
        ({"prompt": [{"role": None, "content": "q"}]}, r"prompt\[0\].role must be a non-empty string"),
        ({"data_source": None}, r"data_source must be a non-empty string naming the data set, got None"),
        ({"data_source": ""}, r"data_source must be a non-empty string"),
    ],
)
def test_bad_rows_are_named_file_row_and_field(tmp_path, change, message):
    """Issue 15, class 6: each of these used to load (empty targets then scored an empty
    answer EM 1.0; empty or null content became the prompt "None") or failed unnamed."""
    path = tmp_path / "rows.parquet"
    # row 1 is the bad one; the good rows around it give pyarrow the column types
    pq.write_table(pa.Table.from_pylist([_record(), _record(**change), _record()]), path)
    with pytest.raises(DataError, match=rf"1 bad row\(s\) of 3 in .*rows.parquet:\n.*rows.parquet:1: .*{message}"):
        read_parquet(path)


def test_columns_of_the_wrong_type_are_named(tmp_path):
    rows = [_record(extra_info="split=train"), _record(extra_info=None)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "e.parquet")
    with pytest.raises(DataError, match=r"of 2 .*\n.*e.parquet:0: extra_info must be a mapping .*'split="):
        read_parquet(tmp_path / "e.parquet")
    pq.write_table(pa.Table.from_pylist([_record(data_source=3), _record(data_source=4)]), tmp_path / "i.parquet")
    with pytest.raises(DataError, match=r"2 bad row\(s\) of 2 .*\n.*i.parquet:0: data_source .* got 3\n.*i.parquet:1"):
        read_parquet(tmp_path / "i.parquet")
    no_target = _record(reward_model={"style": "rule", "ground_truth": {"answers": ["Y"]}})
    pq.write_table(pa.Table.from_pylist([no_target]), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t.parquet:0: reward_model.ground_truth has no 'target' \(keys: \['answers"):
        read_parquet(tmp_path / "t.parquet")


def test_many_bad_rows_are_listed_up_to_a_limit(tmp_path):
    rows = [_record(prompt=[{"role": "user", "content": ""}]) for _ in range(30)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    with pytest.raises(DataError, match=r"30 bad row\(s\) of 30") as err:
        read_parquet(tmp_path / "m.parquet", max_errors=5)
    assert str(err.value).count("m.parquet:") == 5 + 1 and str(err.value).endswith("... and 25 more")


def test_missing_empty_and_non_parquet_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet: no such file"):
        read_parquet(tmp_path / "nope.parquet")
    (tmp_path / "x.parquet").write_text("data_source,prompt\nnq,q\n")
    with pytest.raises(DataError, match="x.parquet: not a readable parquet file"):
        read_parquet(tmp_path / "x.parquet")
    with pytest.raises(DataError, match="not a file"):
        read_parquet(tmp_path)
    pq.write_table(pa.Table.from_pylist([_record()]).slice(0, 0), tmp_path / "empty.parquet")
    assert read_parquet(tmp_path / "empty.parquet") == []


def test_tokenizer_special_tokens_and_template():
    tok = train_tokenizer(["hello world <search> x </search>"] * 10, vocab_size=300)
    for tag in ACTION_TAGS:
        assert len(tok.encode(tag, add_special_tokens=False)) == 1
    text = "héllo <answer> 42 </answer> 🙂"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # byte-level: lossless
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    row = make_row("Q?", ["A"], "nq", "train", 0)
    ids = encode_prompt(tok, row)
    assert tok.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\n") and isinstance(ids[0], int)


def test_synthetic_kb_is_consistent_and_retrievable():
    kb = make_kb(num_people=30, seed=3)
    rows = list(corpus(kb))
    assert len(rows) == 30 + len(kb.cities) + len(kb.companies)
    assert all(r["contents"].startswith('"') and "\n" in r["contents"] for r in rows)
    qs = questions(kb, seed=3)
    assert len(qs) == 4 * 30 and {s for _, s, _ in qs} == {"synthetic_single", "synthetic_multi"}
    from sorl_megatron.retrieval.corpus import Passage

    index = BM25Index([Passage(r["id"], r["contents"]) for r in rows])
    for q, source, plan in qs[:20]:
        hops = 1 if source == "synthetic_single" else 2
        assert len(plan.searches) == hops
        # the last hop's top passage states the answer
        top = index.search([plan.searches[-1]], topk=1)[0][0]
        assert plan.answer in top.contents, (q, plan, top)


def test_cli_writes_everything_and_gold_trajectories_score_1(tmp_path):
    main(["--out", str(tmp_path), "--num-people", "20", "--seed", "1", "--make-model", "--vocab-size", "600"])
    splits = {s: read_parquet(tmp_path / f"{s}.parquet") for s in ("train", "validation", "test")}
    assert sum(len(v) for v in splits.values()) == 80 and len(splits["test"]) >= 8
    gold = [json.loads(line) for line in (tmp_path / "gold.jsonl").read_text().splitlines()]
    assert len(gold) == 80 and gold[0]["turns"][-1].startswith("<think>")
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert (tmp_path / "model" / "config.json").exists()
    # the tokenizer learned the instruction's words: ~105 tokens, not the ~270 of its bytes
    assert len(encode_prompt(tok, splits["train"][0])) < 140
    index = BM25Index(list(read_corpus(tmp_path / "corpus.jsonl")))

    class LocalRetriever:
        async def retrieve(self, queries, topk=None):
            return index.search(queries, topk or 3)

    from sorl_megatron.data.synthetic import GoldPlan

    registry = RewardRegistry()
    for g in gold[:12]:
        row = make_row(g["question"], [g["answer"]], g["data_source"], "train", 0)
        plan = GoldPlan(g["searches"], g["answer"], g["thoughts"])

        def factory(policy):
            return SearchAgent(policy, LocalRetriever(), tok, AgentConfig(max_turns=4))

        traj = asyncio.run(gold_trajectory(factory, tok, encode_prompt(tok, row), plan))
        assert traj.finish_reason == "answer" and traj.num_searches == len(plan.searches)
        assert traj.num_turns == len(plan.searches) + 1 and traj.meta["gold"]
        assert registry.score(row.data_source, traj.turn_texts, {"target": row.targets}) == 1.0
        assert "<information>Doc 1(Title:" in traj.response_text and (traj.rollout_logprobs == 0).all()


def test_tools_wrapper_writes_the_data_set(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "tools" / "make_synthetic_data.py"
    proc = subprocess.run([sys.executable, str(script), "--out", str(tmp_path), "--num-people", "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("corpus.jsonl", "gold.jsonl", "train.parquet", "validation.parquet", "test.parquet"):
        assert (tmp_path / name).stat().st_size > 0, name


def test_tiny_model_vocabulary_is_padded_for_tensor_parallelism(tmp_path):
    import json

    from sorl_megatron.data.tiny_model import VOCAB_MULTIPLE, TinyModelConfig, save_tiny_model
    from sorl_megatron.data.tokenizer import train_tokenizer

    tok = train_tokenizer([f"word{i} other{i * 7}" for i in range(300)], vocab_size=300)
    assert len(tok) % VOCAB_MULTIPLE  # the tokenizer alone would not split over TP = 2, 4, ...
    out = save_tiny_model(TinyModelConfig(arch="qwen2", seed=0), tmp_path / "m", tok)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    assert vocab % VOCAB_MULTIPLE == 0 and len(tok) <= vocab < len(tok) + VOCAB_MULTIPLE


def test_cli_model_size_and_tied_embeddings(tmp_path):
    main(
        [
            "--out",
            str(tmp_path),
            "--num-people",
            "8",
            "--make-model",
            "--vocab-size",
            "512",
            "--hidden-size",
            "32",
            "--tie-embeddings",
        ]
    )
    cfg = json.loads((tmp_path / "model" / "config.json").read_text())
    assert cfg["hidden_size"] == 32 and cfg["num_attention_heads"] == 2 and cfg["tie_word_embeddings"] is True
    with pytest.raises(ValueError, match="hidden_size must be a positive multiple of 16"):
        main(["--out", str(tmp_path / "bad"), "--make-model", "--hidden-size", "40"])
    assert not (tmp_path / "bad").exists()  # rejected before anything is written


def test_cold_start_plans_mix_seeded_direct_guesses_into_the_gold_plans():
    rows = split_rows(questions(make_kb(num_people=100)))["train"] + [make_row("No plan?", ["x"], "nq", "train", 999)]
    gold = cold_start_plans(rows)
    assert sorted(gold) == list(range(len(rows) - 1))  # the row without a gold plan gets none
    assert all(gold[i] == gold_plan(rows[i]) and gold[i].searches for i in gold)
    mixed = cold_start_plans(rows, 0.5, seed=3)
    direct = [i for i, p in mixed.items() if not p.searches]
    assert 0.4 < len(direct) / len(mixed) < 0.6
    targets = {r.targets[0] for r in rows}
    assert all(
        mixed[i].answer in targets
        and mixed[i].turns() == [f"<think> I have the answer. </think>\n<answer> {mixed[i].answer} </answer>"]
        for i in direct
    )
    assert sum(mixed[i].answer != rows[i].targets[0] for i in direct) > 0.8 * len(direct)  # guesses are mostly wrong
    assert all(mixed[i] == gold[i] for i in mixed if i not in direct)
    assert cold_start_plans(rows, 0.5, seed=3) == mixed and cold_start_plans(rows, 0.5, seed=4) != mixed
    with pytest.raises(ValueError, match="direct_answer_fraction"):
        cold_start_plans(rows, 1.0)
