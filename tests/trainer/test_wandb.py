"""logging.wandb: the real wandb package in offline mode, its files under a temporary WANDB_DIR."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sorl_megatron.common.typed_config import to_dict
from sorl_megatron.trainer.metrics.logger import WANDB_ID_FILE, MetricsLogger, open_wandb, read_metrics
from sorl_megatron.trainer.recipe.config import RecipeError
from sorl_megatron.trainer.recipe.loader import load_recipe

wandb = pytest.importorskip("wandb")  # in the dev extra, so `make test` has it

BASE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_search_base.yaml"


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Every W&B file under tmp_path; nothing read from or written to the home directory."""
    for var, sub in (("WANDB_DIR", "wandb_dir"), ("WANDB_CONFIG_DIR", "wandb_config"),
                     ("WANDB_CACHE_DIR", "wandb_cache"), ("WANDB_DATA_DIR", "wandb_data")):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield tmp_path / "wandb_dir"
    wandb.teardown()  # stop the wandb-core service this test started


def _records(run_file: Path):
    """The protobuf records of a ``run-<id>.wandb`` file: a 7-byte header (``:W&B``, magic,
    version), then LevelDB-log framing in 32 KiB blocks (crc32, little-endian length, type)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too short for a header: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # full / last fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + chunk)
            out.append(record)
            pending = b""
        elif kind in (2, 3):  # first / middle fragment
            pending += chunk
    return out


def _history(records) -> list[dict]:
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return rows


def _settings(tmp_path, *extra):
    return load_recipe(BASE, [f"logging.dir={tmp_path}", "logging.run_name=wb", "logging.wandb.mode=offline",
                              "logging.wandb.project=sorl-test", *extra])


def test_offline_run_holds_the_sft_and_rl_curves_beside_unchanged_jsonl(tmp_path, wandb_env):
    cfg = _settings(tmp_path)
    run_dir = tmp_path / "wb"
    run = open_wandb(cfg.logging.wandb, run_dir, "wb", to_dict(cfg), resume=False)
    sft = MetricsLogger(run_dir / "sft", 2, tensorboard=False, progress="none", name="sft", wandb_run=run)
    for step, nll in ((1, 2.5), (2, 1.25)):
        sft.log(step, {"sft/nll": nll})
    sft.close()
    rl = MetricsLogger(run_dir, 2, tensorboard=True, progress="none", wandb_run=run)
    rl.log(0, {"val/em": 0.25})
    rl.log(1, {"rollout/reward": 0.5, "actor/clip_frac": float("nan")})  # non-finite: null in JSONL, not sent
    rl.log(2, {"rollout/reward": 0.75, "val/em": 0.5})
    rl.close()
    run.finish()
    wandb.teardown()  # the wandb-core service writes the run file on its own time; stopping it flushes it

    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    [run_file] = list(wandb_env.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    records = _records(run_file)
    history = [{k: v for k, v in row.items() if not k.startswith("_")} for row in _history(records)]
    assert history == [
        {"sft/nll": 2.5, "sft/step": 1}, {"sft/nll": 1.25, "sft/step": 2},
        {"val/em": 0.25, "rl/step": 0}, {"rollout/reward": 0.5, "rl/step": 1},
        {"rollout/reward": 0.75, "val/em": 0.5, "rl/step": 2},
    ]
    metrics = {m.metric.name: m.metric.step_metric for m in records if m.WhichOneof("record_type") == "metric"}
    assert metrics["sft/nll"] == "sft/step" and metrics["rollout/reward"] == metrics["val/em"] == "rl/step"
    [run_record] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run_record.run_id, run_record.display_name, run_record.project) == (run_id, "wb", "sorl-test")
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert config["schedule"]["total_steps"] == cfg.schedule.total_steps
    # the JSONL and TensorBoard logs are what they are without W&B
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["actor/clip_frac"] is None
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_a_resumed_run_continues_its_wandb_run(tmp_path, wandb_env):
    cfg = _settings(tmp_path, "logging.wandb.name=display")
    first = open_wandb(cfg.logging.wandb, tmp_path / "wb", "wb", {}, resume=False)
    run_id = first.id
    first.finish()
    again = open_wandb(cfg.logging.wandb, tmp_path / "wb", "wb", {}, resume=True)
    assert again.id == run_id and again.name == "display"
    again.finish()
    fresh = open_wandb(cfg.logging.wandb, tmp_path / "wb", "wb", {}, resume=False)  # checkpoint.resume=none
    assert fresh.id != run_id and (tmp_path / "wb" / WANDB_ID_FILE).read_text().strip() == fresh.id
    fresh.finish()


def test_disabled_by_default_and_nothing_written(tmp_path):
    cfg = load_recipe(BASE, [f"logging.dir={tmp_path}"])
    assert cfg.logging.wandb.mode == "disabled"
    assert open_wandb(cfg.logging.wandb, tmp_path / "run", "run", {}, resume=False) is None
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override,message", [
    ("logging.wandb.mode=live", r"logging.wandb.mode: 'live' is not one of \['online', 'offline', 'disabled'\]"),
    ("logging.wandb.projekt=x", r"logging.wandb.projekt \(did you mean logging.wandb.project\?\)"),
    ("logging.wandb.init_timeout_s=0", r"logging.wandb.init_timeout_s must be > 0"),
])
def test_bad_wandb_settings_name_the_key(override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(BASE, ["logging.wandb.mode=offline", override])


def test_missing_package_is_a_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(RecipeError, match=r"logging.wandb.mode=online needs the wandb package: pip install"):
        load_recipe(BASE, ["logging.wandb.mode=online"])
    load_recipe(BASE)  # disabled: no package needed
