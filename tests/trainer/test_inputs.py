"""Input files are checked before anything starts (issue 15, class 6): train.py refuses bad
data, corpus and resume paths with one clear line per problem, no traceback and no run
directory left behind."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sorl_megatron.data.qa import make_row, write_parquet
from sorl_megatron.trainer.recipe.inputs import InputError, validate_inputs
from sorl_megatron.trainer.recipe.loader import load_recipe

from .test_config import BASE, TINY_MOE, _hf_config


@pytest.fixture
def inputs(tmp_path):
    """Good files: 3 train rows, 1 val row, a 2-passage corpus, a model config."""
    rows = [make_row(f"q{i}?", [f"a{i}"], "nq", "train", i) for i in range(3)]
    files = {
        "model.path": str(_hf_config(tmp_path / "model", **TINY_MOE)),
        "data.train": str(write_parquet(rows, tmp_path / "train.parquet")),
        "data.val": str(write_parquet(rows[:1], tmp_path / "val.parquet")),
        "retrieval.corpus": str(tmp_path / "corpus.jsonl"),
        "logging.dir": str(tmp_path / "runs"),
    }
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"id": str(i), "contents": f'"T{i}"\ntext {i}'}) + "\n"
                                                   for i in range(2)))
    return tmp_path, files


def launch(files, monkeypatch, capsys, **change):
    from sorl_megatron.train import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    overrides = [f"{k}={v}" for k, v in {**files, **change}.items()]
    code = main(["--config", str(BASE), *overrides])
    return code, capsys.readouterr().err


def cfg_of(files, **change):
    return load_recipe(BASE, [f"{k}={v}" for k, v in {**files, **change}.items()])


def test_good_inputs_pass_and_are_counted(inputs):
    _, files = inputs
    summary = validate_inputs(cfg_of(files))
    assert (summary.train_rows, summary.val_rows, summary.passages) == (3, 1, 2)
    assert validate_inputs(cfg_of(files), check_corpus=False).passages is None
    # an external retrieval server: the corpus is not needed
    external = cfg_of(files, **{"retrieval.url": "http://127.0.0.1:1", "retrieval.corpus": "''"})
    assert validate_inputs(external).passages is None


@pytest.mark.parametrize("key", ["data.train", "data.val", "retrieval.corpus"])
def test_a_wrong_path_fails_at_launch_without_a_run_directory(inputs, monkeypatch, capsys, key):
    tmp_path, files = inputs
    code, err = launch(files, monkeypatch, capsys, **{key: str(tmp_path / "missing.file")})
    assert code == 2 and err.startswith(f"input error: {key}: ") and "missing.file' does not exist" in err
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_a_relative_path_that_is_missing_names_the_directory_it_was_looked_up_in(inputs, monkeypatch, capsys):
    """Issue 48: every path is relative to the working directory; run from another directory,
    the error says which one it looked in."""
    tmp_path, files = inputs
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, err = launch(files, monkeypatch, capsys, **{"data.train": "runs/tiny/train.parquet"})
    assert code == 2, err
    assert f"data.train: 'runs/tiny/train.parquet' does not exist (relative to the working directory {elsewhere})" \
        in err


def test_an_empty_training_file_says_so(inputs, monkeypatch, capsys):
    tmp_path, files = inputs
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(files["data.train"]).slice(0, 0), empty)
    code, err = launch(files, monkeypatch, capsys, **{"data.train": str(empty)})
    assert code == 2 and "data.train: " in err and "has no rows: there is nothing to train on" in err
    assert "PVPO" not in err and not (tmp_path / "runs").exists()
    (tmp_path / "zero.parquet").write_bytes(b"")
    with pytest.raises(InputError, match=r"data.train: .*zero.parquet is empty"):
        validate_inputs(cfg_of(files, **{"data.train": str(tmp_path / "zero.parquet")}))
    with pytest.raises(InputError, match=r"data.val: .*empty.parquet has no rows \(set data.val= to run without"):
        validate_inputs(cfg_of(files, **{"data.val": str(empty)}))


def test_bad_rows_are_listed_as_file_row(inputs, monkeypatch, capsys):
    tmp_path, files = inputs
    good = make_row("q?", ["a"], "nq", "train", 0).to_record()
    bad = [good, {**good, "reward_model": {"style": "rule", "ground_truth": {"target": [""]}}},
           {**good, "prompt": [{"role": "user", "content": ""}]}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet")
    code, err = launch(files, monkeypatch, capsys, **{"data.train": str(tmp_path / "bad.parquet")})
    path = tmp_path / "bad.parquet"
    assert code == 2 and f"input error: data.train: 2 bad row(s) of 3 in {path}:" in err
    assert f"{path}:1: target[0] is empty" in err and f"{path}:2: prompt[0].content must be" in err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


def test_rows_the_reward_cannot_score(inputs):
    tmp_path, files = inputs
    rows = [make_row("q?", ["Paris"], "nq", "train", 0), make_row("q?", ["Paris"], "my_qa", "train", 1),
            make_row("q?", ["The", "a"], "hotpotqa", "train", 2), make_row("q?", ["12"], "medqa", "train", 3)]
    path = write_parquet(rows, tmp_path / "r.parquet")
    with pytest.raises(InputError) as err:
        validate_inputs(cfg_of(files, **{"data.train": str(path)}))
    msg = str(err.value)
    assert msg.startswith(f"data.train: 3 row(s) of {path} cannot be scored:")
    assert f"{path}:1: data_source 'my_qa' has no reward (known: " in msg and "nq" in msg
    assert f"{path}:2: every target is empty after answer normalization (['The', 'a'])" in msg
    assert f"{path}:3: no option letter in the targets ['12']" in msg
    # a recipe-wide metric override still needs a known data_source
    with pytest.raises(InputError, match="my_qa"):
        validate_inputs(cfg_of(files, **{"data.train": str(path), "reward.metric": "f1"}))


def test_a_bad_corpus_is_named_with_its_line(inputs, monkeypatch, capsys):
    tmp_path, files = inputs
    corpus = tmp_path / "latin1.jsonl"
    corpus.write_bytes(b'{"id": "0", "contents": "ok"}\n{"id": "1", "contents": "caf\xe9"}\n')
    code, err = launch(files, monkeypatch, capsys, **{"retrieval.corpus": str(corpus)})
    assert code == 2 and f"input error: retrieval.corpus: {corpus}:2: not valid UTF-8" in err
    assert not (tmp_path / "runs").exists()
    # only the rank that serves the corpus scans it
    monkeypatch.setenv("RANK", "1")
    assert validate_inputs(cfg_of(files, **{"retrieval.corpus": str(corpus)}), check_corpus=False).passages is None
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(InputError, match=r"retrieval.corpus: .*blank.jsonl has no passages"):
        validate_inputs(cfg_of(files, **{"retrieval.corpus": str(blank)}))
    with pytest.raises(InputError, match=r"retrieval.corpus: .* is not a file"):
        validate_inputs(cfg_of(files, **{"retrieval.corpus": str(tmp_path)}))


def test_resume_directory_must_exist(inputs, monkeypatch, capsys):
    tmp_path, files = inputs
    code, err = launch(files, monkeypatch, capsys, **{"checkpoint.resume": str(tmp_path / "ckpt" / "step_4")})
    assert code == 2 and "input error: checkpoint.resume: " in err and "step_4 is not a directory" in err
    (tmp_path / "ckpt" / "step_4").mkdir(parents=True)
    validate_inputs(cfg_of(files, **{"checkpoint.resume": str(tmp_path / "ckpt" / "step_4")}))


def test_a_tokenizer_that_needs_the_models_own_code_is_refused_naming_model_path(tmp_path):
    """Moonlight-style: the tokenizer is custom code (auto_map); transformers would need
    trust_remote_code, which this package never sets: one clear error naming model.path."""
    from sorl_megatron.trainer.recipe.inputs import load_tokenizer

    model = tmp_path / "custom_tok"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    (model / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_moonshot.TikTokenTokenizer", None]},
    }))
    (model / "tokenization_moonshot.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(InputError, match=r"model.path: .*custom_tok has no tokenizer transformers can load "
                                         r"without running the model's own code .*tokenizer.json"):
        load_tokenizer(str(model))


def test_a_corpus_that_indexes_to_nothing_is_refused(inputs, monkeypatch, capsys):
    """Passages of stop words only: the embedded retrieval server would die building its index."""
    tmp_path, files = inputs
    corpus = tmp_path / "stop.jsonl"
    rows = [{"id": "0", "contents": "The\nof the"}, {"id": "1", "contents": "is a"}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, err = launch(files, monkeypatch, capsys, **{"retrieval.corpus": str(corpus)})
    assert code == 2 and f"input error: retrieval.corpus: {corpus}: no passage has a word BM25 can index" in err
    assert not (tmp_path / "runs").exists()
    corpus.write_text(corpus.read_text() + json.dumps({"id": "2", "contents": "Eiffel"}) + "\n")
    assert validate_inputs(cfg_of(files, **{"retrieval.corpus": str(corpus)})).passages == 3
