import json
from pathlib import Path

import pytest

from sorl_megatron.algorithms import POLICY_LOSSES
from sorl_megatron.common.typed_config import build_dataclass, config_key
from sorl_megatron.trainer.recipe.config import RecipeError, TrainConfig
from sorl_megatron.trainer.recipe.launch_checks import validate_layout_for_launch
from sorl_megatron.trainer.recipe.loader import dump_config, load_recipe

RECIPES = sorted(p for p in Path(__file__).resolve().parents[2].joinpath("recipes").rglob("*.yaml")
                 if p.parent.name != "study")  # study recipes: tests/test_study.py
BASE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_search_base.yaml"
GPU = BASE.parent / "gpu"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_recipe_validates(recipe):
    cfg = load_recipe(recipe)
    assert cfg.algorithm.loss.name in POLICY_LOSSES
    assert "algorithm:" in dump_config(cfg)


def test_defaults_chain_and_dotted_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("schedule:\n  total_steps: 7\nalgorithm:\n  loss:\n    name: ppo\n"
                                        "model:\n  path: m\ndata:\n  train: t.parquet\nretrieval:\n  corpus: c.jsonl\n")
    (tmp_path / "mid.yaml").write_text("defaults: [base]\nalgorithm:\n  loss:\n    name: so_ppo\n")
    (tmp_path / "top.yaml").write_text("defaults: [mid.yaml]\nrollout:\n  group_size: 2\n")
    cfg = load_recipe(tmp_path / "top.yaml", ["algorithm.loss.clip_bias.mode=scalar", "schedule.batch_size=8"])
    assert cfg.schedule.total_steps == 7 and cfg.algorithm.loss.name == "so_ppo"
    assert cfg.algorithm.loss.clip_bias.mode == "scalar" and cfg.schedule.batch_size == 8


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["algorithm.loss.nme=ppo"], r"algorithm.loss.nme \(did you mean algorithm.loss.name\?\)"),
        (["schedulee.total_steps=3"], r"schedulee \(did you mean schedule\?\)"),
        (["schedule.total_steps=abc"], r"schedule.total_steps must be an integer"),
        (["algorithm.loss.name=ppo3"], r"algorithm.loss.name: unknown policy loss 'ppo3'"),
        (["algorithm.loss.eps_low=0"], r"algorithm.loss.eps_low must be"),
        (["algorithm.loss.clip_bias.delta=-1"], r"algorithm.loss.clip_bias.delta must be"),
        (["algorithm.routing_replay=r4"], r"algorithm.routing_replay: 'r4' is not one of"),
        (["schedule.mini_batch_size=7"], r"schedule.mini_batch_size=7 must divide"),
        (["schedule.micro_batch_size=3"], r"schedule.micro_batch_size=3 must divide"),
        (["schedule.max_tokens_per_micro_batch=600"],
         r"schedule.max_tokens_per_micro_batch=600 must be >= rollout.max_total_tokens=640"),
        (["schedule.max_tokens_per_micro_batch=0"], r"schedule.max_tokens_per_micro_batch=0 must be >="),
        (["schedule.max_tokens_per_micro_batch=abc"], r"schedule.max_tokens_per_micro_batch must be an integer"),
        (["schedule.pack_sequences=maybe"], r"schedule.pack_sequences"),
        (["rollout.group_size=1", "schedule.mini_batch_size=8"], r"needs rollout.group_size >= 2"),
        (["rollout.top_p=1.5"], r"rollout.top_p"),
        (["sft.direct_answer_fraction=1.0"], r"sft.direct_answer_fraction must be in \[0, 1\)"),
        (["notakeyvalue"], r"is not key=value"),
        (["model.path=''"], r"model.path is empty"),
        (["model.path="], r"model.path must be a string, got None"),
        (["data.train=''"], r"data.train is empty"),
        (["retrieval.corpus=''"], r"retrieval.corpus is empty and retrieval.url is not set"),
        (["rollout.max_turn_tokens=0"], r"rollout.max_turn_tokens must be >= 1, got 0"),
        (["rollout.max_total_tokens=-5"], r"rollout.max_total_tokens must be >= 1"),
        (["rollout.max_obs_tokens=0"], r"rollout.max_obs_tokens must be >= 1"),
        (["rollout.concurrency=0"], r"rollout.concurrency must be >= 1"),
        (["rollout.mode=eventually"], r"rollout.mode: 'eventually' is not one of"),
        (["rollout.mode=async", "rollout.staleness.max=0"], r"rollout.mode=async with rollout.staleness.max=0"),
        (["rollout.mode=one_step_off", "rollout.staleness.max=0"], r"rollout.staleness.max must be >= 1"),
        (["rollout.mode=lagged", "rollout.lagged.lag=3"],
         r"rollout.mode=lagged .* rollout.staleness.max=1 must be >= 3"),
        (["rollout.lagged.lag=0"], r"rollout.lagged.lag must be >= 1, got 0"),
        (["rollout.inject.route_flip_fraction=1.5"], r"rollout.inject.route_flip_fraction must be in \[0, 1\]"),
        (["rollout.inject.route_flip_fraction=.nan"], r"rollout.inject.route_flip_fraction"),
        (["rollout.inject.seed=-1"], r"rollout.inject.seed must be in \[0, 2\^31\)"),
        (["rollout.inject.flip=0.1"], r"rollout.inject.flip"),
        (["rollout.mode=async", "rollout.staleness.stale_groups=keep"],
         r"stale_groups=keep .* algorithm.loss.is_correction"),
        (["rollout.dynamic_sampling_max_groups=1"], r"rollout.dynamic_sampling_max_groups=1 must be 0 or >= schedule"),
        (["rollout.overlong=cut"], r"rollout.overlong: 'cut' is not one of"),
        (["rollout.overlong_buffer=5000"], r"rollout.overlong_buffer=5000 must be < rollout.max_total_tokens"),
        (["rollout.timeout_s=0"], r"rollout.timeout_s must be > 0"),
        (["data.max_prompt_tokens=0"], r"data.max_prompt_tokens must be >= 1"),
        (["sft.batch_size=0"], r"sft.batch_size must be >= 1"),
        (["sft.save_every=-1"], r"sft.save_every must be >= 0"),
        (["sft.micro_batch_size=0"], r"sft.micro_batch_size must be >= 1"),
        (["sft.micro_batch_size=3", "sft.pack_sequences=false"],
         r"sft.micro_batch_size=3 must divide sft.batch_size=16"),
        (["schedule.micro_batch_size=3", "schedule.mini_batch_size=3", "rollout.group_size=3", "schedule.batch_size=1",
          "sft.micro_batch_size=null", "sft.pack_sequences=null"],
         r"schedule.micro_batch_size=3 must divide sft.batch_size=16"),
        (["schedule.val_every=-1"], r"schedule.val_every must be >= 0"),
        (["checkpoint.save_every=-1"], r"checkpoint.save_every must be >= 0"),
        (["checkpoint.keep_last=-1"], r"checkpoint.keep_last must be >= 0"),
        (["optimizer.critic_warmup_steps=-1"], r"optimizer.critic_warmup_steps must be >= 0"),
        (
            ["algorithm.advantage.estimator=pvpo", "algorithm.pvpo.refresh_at=[0,5]"],
            r"algorithm.pvpo.refresh_at steps must be >= 1",
        ),
        (["parallelism.vpp=2"], r"parallelism.vpp=2 needs parallelism.pp > 1"),
        (["logging.progress=rich"], r"logging.progress: 'rich' is not one of \['tqdm', 'plain', 'none'\]"),
        (["reward.metric=substring"], r"reward.metric: 'substring' is not one of"),
        (["reward.format_weight=1.5"], r"reward.format_weight must be in \[0, 1\]"),
        # issue 15, class 6: non-finite and out-of-range numbers, URLs, enums
        (["optimizer.lr=.nan"], r"optimizer.lr must be finite, got nan"),
        (["optimizer.lr=.inf"], r"optimizer.lr must be finite, got inf"),
        (["optimizer.critic_lr=-.inf"], r"optimizer.critic_lr must be finite and > 0, got -inf"),
        (["rollout.temperature=.nan"], r"rollout.temperature must be a finite number, got nan"),
        (["rollout.timeout_s=.inf"], r"rollout.timeout_s must be a finite number"),
        (["algorithm.value_clip=.nan"], r"algorithm.value_clip must be a finite number"),
        (["algorithm.loss.kl_coef=.nan"], r"algorithm.loss.kl_coef must be a finite number"),
        (["sft.lr=.nan"], r"sft.lr must be a finite number"),
        (["sft.lr=0"], r"sft.lr must be > 0"),
        (["optimizer.clip_grad=-5"], r"optimizer.clip_grad must be >= 0 \(0 = off\), got -5"),
        (["optimizer.weight_decay=-1"], r"optimizer.weight_decay must be >= 0, got -1"),
        (["optimizer.adam_beta1=2"], r"optimizer.adam_beta1/adam_beta2 must be in \[0, 1\), got 2"),
        (["optimizer.adam_beta2=1"], r"optimizer.adam_beta1/adam_beta2 must be in \[0, 1\), got 0.9/1"),
        (["optimizer.adam_eps=0"], r"optimizer.adam_eps must be > 0"),
        (["optimizer.min_lr=1.0"], r"optimizer.min_lr must be in \[0, lr\], got 1.0"),
        (["optimizer.min_lr=-1e-9"], r"optimizer.min_lr must be in \[0, lr\]"),
        (["algorithm.advantage.gamma=5"], r"algorithm.advantage.gamma must be in \[0, 1\], got 5"),
        (["algorithm.advantage.lam=-1"], r"algorithm.advantage.lam must be in \[0, 1\], got -1"),
        (["rollout.max_obs_tokens=640"], r"rollout.max_obs_tokens=640 must be < rollout.max_total_tokens=640"),
        (["rollout.max_turn_tokens=700"], r"rollout.max_turn_tokens=700 must be < rollout.max_total_tokens=640"),
        (["data.max_prompt_tokens=2048"], r"data.max_prompt_tokens=2048 must be < rollout.max_total_tokens=640"),
        (["rollout.top_k=0"], r"rollout.top_k must be -1 \(off\) or >= 1"),
        (["rollout.deterministic=true", "rollout.urls=[http://a:30000]"],
         r"rollout.deterministic is for embedded servers; launch external SGLang servers with "
         r"--enable-deterministic-inference"),
        (["checkpoint.resume=atuo"], r"checkpoint.resume: 'atuo' is not auto, none or a checkpoint directory "
                                     r"\(did you mean auto\?\)"),
        (["checkpoint.resume=Non"], r"\(did you mean none\?\)"),
        (["checkpoint.resume=''"], r"checkpoint.resume is empty"),
        (["rollout.urls=[not_a_url]"], r"rollout.urls\[0\]: 'not_a_url' is not an http\(s\) URL"),
        (["rollout.urls=[http://a:30000,localhost:30000]"], r"rollout.urls\[1\]: 'localhost:30000' is not an http"),
        (["rollout.urls=[http://a:99999]"], r"rollout.urls\[0\]: 'http://a:99999' is not a valid URL"),
        (["retrieval.url=ftp://x"], r"retrieval.url: 'ftp://x' is not an http\(s\) URL"),
        (["retrieval.url=http://"], r"retrieval.url: 'http://' is not an http\(s\) URL with a host"),
        (["rollout.weight_sync.transport=nccl"], r"rollout.weight_sync.transport: 'nccl' is not one of .*distributed"),
        (["rollout.weight_sync.timeout_s=0"], r"rollout.weight_sync.timeout_s must be > 0 seconds"),
        (["rollout.weight_sync.bucket_mb=0"], r"rollout.weight_sync.bucket_mb"),
        (["rollout.weight_sync.init_timeout_s=0"], r"rollout.weight_sync.init_timeout_s must be > 0 seconds"),
        (["rollout.weight_sync.master_address='a b'"], r"rollout.weight_sync.master_address must be a host name"),
        (["parallelism.collective_timeout_s=0"], r"parallelism.collective_timeout_s must be > 0 seconds"),
        (["parallelism.rank0_phase_timeout_s=.inf"], r"parallelism.rank0_phase_timeout_s must be a finite number"),
        (["data.val_max_rows=-1"], r"data.val_max_rows must be >= 0, got -1"),
        ([f"schedule.seed={2**70}"], r"schedule.seed must be in \[0, 2147483647\], got 1180591620717411303424"),
        (["schedule.seed=-1"], r"schedule.seed must be in \[0, 2147483647\]"),
        (["logging.run_name=../../x"], r"logging.run_name must be one path component"),
        (["logging.run_name=/abs/x"], r"logging.run_name must be one path component"),
        (["logging.run_name=.."], r"logging.run_name must be one path component"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(BASE, overrides)


@pytest.mark.parametrize("resume", ["auto", "none", "runs/x/checkpoints/step_4", "./step_4", "/abs/step_4"])
def test_resume_takes_auto_none_or_a_path(resume):
    assert load_recipe(BASE, [f"checkpoint.resume={resume}"]).checkpoint.resume == resume


def test_print_config_rejects_bad_values_naming_the_key(capsys):
    from sorl_megatron.train import main

    for override, key in [("optimizer.lr=.nan", "optimizer.lr"), ("checkpoint.resume=atuo", "checkpoint.resume"),
                          ("retrieval.url=ftp://x", "retrieval.url"), ("algorithm.advantage.gamma=5", "gamma")]:
        assert main(["--config", str(BASE), "--print-config", override]) == 2
        err = capsys.readouterr().err
        assert err.startswith("config error: ") and key in err and "Traceback" not in err


def test_every_float_field_gets_the_finite_check():
    """Walk the schema: each float key set to NaN is refused naming that key."""
    import dataclasses
    import typing

    def float_keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            key = f"{prefix}{config_key(f)}"
            if dataclasses.is_dataclass(hint):
                yield from float_keys(hint, key + ".")
            elif hint is float or float in typing.get_args(hint):
                yield key

    keys = list(float_keys(TrainConfig))
    assert len(keys) > 20 and "optimizer.lr" in keys and "algorithm.loss.is_correction.cap" in keys
    assert "rollout.async.flush_idle_timeout_s" in keys and "rollout.weight_sync.timeout_s" in keys
    for key in keys:
        with pytest.raises(RecipeError, match=rf"{key.replace('.', '[.]')}.* finite"):
            load_recipe(BASE, [f"{key}=.nan"])


def test_missing_and_cyclic_recipes(tmp_path):
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")
    (tmp_path / "a.yaml").write_text("defaults: [b]\n")
    (tmp_path / "b.yaml").write_text("defaults: [a]\n")
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("defaults: [missing_parent]\n")
    with pytest.raises(RecipeError, match="listed in the defaults of"):
        load_recipe(tmp_path / "c.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(tmp_path / "bad.yaml")


def test_a_wrong_recipe_path_lists_the_recipes_nearby(monkeypatch, capsys):
    """``--config recipes/nope.yaml``: the error names the path and lists the recipes of its
    directory (and its subdirectories), with the closest one first."""
    from sorl_megatron.train import main

    monkeypatch.chdir(BASE.parents[1])
    assert main(["--config", "recipes/nope.yaml", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: recipe {BASE.parent / 'nope.yaml'} not found") and "Traceback" not in err
    listed = err.split(f"the recipes in {BASE.parent}: ")[1].strip().split(", ")
    here = sorted(p.name for p in BASE.parent.glob("*.yaml"))
    assert listed == here + sorted(str(p.relative_to(BASE.parent)) for p in BASE.parent.glob("*/*.yaml"))
    assert "tiny_search_base.yaml" in listed and "gpu/sorl_qwen2.5_7b_so_ppo.yaml" in listed
    # a typo gets a did-you-mean, also across a subdirectory; a missing directory lists its parent's recipes
    for path, close in [("recipes/tiny_search_sogrpo.yaml", "tiny_search_so_grpo.yaml"),
                        ("recipes/sorl_qwen2.5_7b_so_ppo.yaml", "gpu/sorl_qwen2.5_7b_so_ppo.yaml"),
                        ("recipes/gpus/sorl_qwen2.5_7b_ppo.yaml", "gpu/sorl_qwen2.5_7b_ppo.yaml")]:
        with pytest.raises(RecipeError, match=rf"not found; did you mean {BASE.parent / close}\?; the recipes in "):
            load_recipe(path)


def test_a_missing_parent_recipe_lists_its_neighbours(tmp_path):
    (tmp_path / "base.yaml").write_text(_PARENT)
    (tmp_path / "top.yaml").write_text("defaults: [bsae]\n")
    (tmp_path / ".hidden.yaml").write_text("{}\n")
    with pytest.raises(RecipeError, match=rf"recipe {tmp_path / 'bsae'} not found \(listed in the defaults of "
                                          rf"{tmp_path / 'top.yaml'}\); did you mean {tmp_path / 'base.yaml'}\?; "
                                          rf"the recipes in {tmp_path}: base.yaml, top.yaml$"):
        load_recipe(tmp_path / "top.yaml")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RecipeError, match=rf"{empty} holds no recipes"):
        load_recipe(empty / "nope.yaml")
    many = tmp_path / "many"
    many.mkdir()
    for i in range(45):
        (many / f"r{i:02d}.yaml").write_text("{}\n")
    with pytest.raises(RecipeError, match=r"r39.yaml, ... \(5 more\)$"):
        load_recipe(many / "zzz.yaml")


_PARENT = ("schedule:\n  total_steps: 7\nmodel:\n  path: m\ndata:\n  train: t.parquet\n"
           "retrieval:\n  corpus: c.jsonl\n")


@pytest.mark.parametrize("defaults", ["base.yaml", "base", "[base]", "[base.yaml]", "\n  - base.yaml"])
def test_defaults_as_a_string_or_a_list(tmp_path, defaults):
    """NeMo-RL's loader takes ``defaults: parent.yaml`` (one string) as well as a list."""
    (tmp_path / "base.yaml").write_text(_PARENT)
    (tmp_path / "top.yaml").write_text(f"defaults: {defaults}\nrollout:\n  group_size: 2\n")
    cfg = load_recipe(tmp_path / "top.yaml")
    assert cfg.schedule.total_steps == 7 and cfg.model.path == "m" and cfg.rollout.group_size == 2


def test_a_string_default_chains_and_names_its_file_when_missing(tmp_path):
    (tmp_path / "base.yaml").write_text(_PARENT)
    (tmp_path / "mid.yaml").write_text("defaults: base\nschedule:\n  batch_size: 16\n")
    (tmp_path / "top.yaml").write_text("defaults: mid.yaml\nrollout:\n  group_size: 2\n")
    cfg = load_recipe(tmp_path / "top.yaml")
    assert (cfg.schedule.total_steps, cfg.schedule.batch_size) == (7, 16)
    (tmp_path / "orphan.yaml").write_text("defaults: parent.yaml\n")
    with pytest.raises(RecipeError, match=rf"recipe {tmp_path / 'parent.yaml'} not found \(listed in the defaults "
                                          rf"of {tmp_path / 'orphan.yaml'}\)"):
        load_recipe(tmp_path / "orphan.yaml")


@pytest.mark.parametrize("defaults,message", [
    ("5", r"defaults must be a recipe path or a list of them, got 5"),
    ("{a: b}", r"defaults must be a recipe path or a list of them"),
    ("['']", r"defaults entries must be recipe paths \(non-empty strings\), got ''"),
    ("[[a]]", r"defaults entries must be recipe paths"),
    ("'/'", r"recipe / not found"),
])
def test_bad_defaults_name_the_file(tmp_path, defaults, message):
    (tmp_path / "r.yaml").write_text(f"defaults: {defaults}\n")
    with pytest.raises(RecipeError, match=message) as err:
        load_recipe(tmp_path / "r.yaml")
    assert "r.yaml" in str(err.value) or "not found" in str(err.value)


def test_hydra_style_overrides_add_keys_the_schema_allows():
    plain = load_recipe(BASE)
    assert plain.checkpoint.keep_last == 2 and plain.algorithm.loss.kl_coef == 0.0  # not set in the recipe files
    cfg = load_recipe(BASE, ["+checkpoint.keep_last=5", "++schedule.total_steps=3", "algorithm.loss.kl_coef=0.01",
                             "+rollout.urls=[http://a:30000]"])
    assert (cfg.checkpoint.keep_last, cfg.schedule.total_steps, cfg.algorithm.loss.kl_coef) == (5, 3, 0.01)
    assert cfg.rollout.urls == ["http://a:30000"]


@pytest.mark.parametrize("override,message", [
    ("+algorithm.loss.nme=ppo", r"unknown config key\(s\): algorithm.loss.nme \(did you mean algorithm.loss.name\?\)"),
    ("++schedulee.total_steps=3", r"unknown config key\(s\): schedulee \(did you mean schedule\?\)"),
    ("+logging.wandb_project=x", r"unknown config key\(s\): logging.wandb_project"),
    ("+=3", r"override '\+=3' is not key=value, \+key=value or \+\+key=value"),
    ("+++a=1", r"is not key=value"),
    ("+ schedule.seed=1", r"is not key=value"),
    ("+schedule.seed", r"override '\+schedule.seed' is not key=value"),
    ("~schedule.seed", r"override '~schedule.seed': deleting a key \(~key\) is not supported"),
    ("model=[1]", r"overrides \['model=\[1\]'\] do not fit .*tiny_search_base.yaml: Cannot merge"),
])
def test_bad_hydra_style_overrides_name_the_key(override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(BASE, [override])


def test_packing_frees_the_micro_batch_divisibility():
    cfg = load_recipe(BASE, ["schedule.pack_sequences=true", "schedule.micro_batch_size=3",
                             "schedule.max_tokens_per_micro_batch=4096"])
    assert cfg.schedule.pack_sequences and cfg.schedule.max_tokens_per_micro_batch == 4096


def test_zero_periods_and_a_retrieval_url_without_corpus_are_fine():
    cfg = load_recipe(BASE, ["schedule.val_every=0", "checkpoint.save_every=0", "checkpoint.keep_last=0",
                             "retrieval.corpus=''", "retrieval.url=http://localhost:8000/retrieve", "sft.enabled=false",
                             "sft.batch_size=0", "parallelism.pp=2", "parallelism.vpp=2"])
    assert cfg.retrieval.corpus == "" and cfg.parallelism.vpp == 2


def test_checkpoint_dir_defaults_to_the_run_directory(tmp_path):
    cfg = load_recipe(BASE)
    assert cfg.checkpoint.dir == str(Path("runs/tiny_search") / "so_grpo" / "checkpoints")
    assert f"dir: {cfg.checkpoint.dir}" in dump_config(cfg)
    # each shipped run gets its own directory: resume=auto never continues another run
    # (tiny_search_base and tiny_search_so_grpo are the same run, so_grpo)
    cfgs = [load_recipe(r) for r in RECIPES]
    for c in cfgs:
        assert c.checkpoint.dir == str(Path(c.logging.dir) / c.logging.run_name / "checkpoints")
    assert len({c.checkpoint.dir for c in cfgs}) == len(RECIPES) - 1
    moved = load_recipe(BASE, ["logging.dir=/tmp/x", "logging.run_name=abc"])
    assert moved.checkpoint.dir == str(Path("/tmp/x/abc/checkpoints"))
    assert load_recipe(BASE, ["checkpoint.dir="]).checkpoint.dir == cfg.checkpoint.dir  # null: the default
    assert load_recipe(BASE, ["checkpoint.dir=''"]).checkpoint.dir == cfg.checkpoint.dir  # empty: the default too
    assert load_recipe(BASE, [f"checkpoint.dir={tmp_path}"]).checkpoint.dir == str(tmp_path)


def test_reward_group():
    cfg = load_recipe(BASE)
    assert cfg.reward.metric is None and cfg.reward.format_weight == 0.0
    cfg = load_recipe(BASE, ["reward.metric=f1", "reward.format_weight=0.1"])
    assert cfg.reward.metric == "f1" and cfg.reward.format_weight == 0.1
    assert load_recipe(GPU / "sapo_qwen2.5_3b.yaml").reward.metric == "f1"  # SAPO trains on F1
    from sorl_megatron.rewards.registry import RewardRegistry
    from sorl_megatron.trainer.recipe.config import RewardConfig

    # every schema value is one the registry takes
    for metric in (None, "em", "f1"):
        RewardRegistry(metric_override=RewardConfig(metric=metric).metric).get("nq")


def _hf_config(directory: Path, **fields) -> Path:
    """A config.json with a model's shape (no weights): enough for the launch checks."""
    directory.mkdir(parents=True, exist_ok=True)
    heads = fields["num_attention_heads"]
    (directory / "config.json").write_text(json.dumps({"hidden_size": 8 * heads, "rope_theta": 1e6, **fields}))
    return directory


TINY_MOE = dict(
    model_type="qwen3_moe",
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    intermediate_size=64,
    vocab_size=512,
)


def test_layout_checks_against_world_size_and_model(tmp_path):
    model = _hf_config(tmp_path / "model", **TINY_MOE)

    def cfg(**par):
        return build_dataclass(TrainConfig, {"model": {"path": str(model)}, "parallelism": par, "data": {"train": "t"},
                                             "retrieval": {"corpus": "c"},
                                             "schedule": {"mini_batch_size": 16, "micro_batch_size": 4}})
    validate_layout_for_launch(cfg(tp=2), world_size=2)
    validate_layout_for_launch(cfg(ep=2), world_size=2)
    validate_layout_for_launch(cfg(ep=4, pp=2), world_size=8)
    with pytest.raises(RecipeError, match="does not divide the world size 3"):
        validate_layout_for_launch(cfg(tp=2), world_size=3)
    with pytest.raises(RecipeError, match="parallelism.tp=4 does not divide the model's 4 attention / 2 KV heads"):
        validate_layout_for_launch(cfg(tp=4), world_size=4)
    with pytest.raises(RecipeError, match="parallelism.pp x vpp = 4 does not divide the model's 2 layers"):
        validate_layout_for_launch(cfg(pp=2, vpp=2), world_size=2)
    with pytest.raises(RecipeError, match="parallelism.ep=3 does not divide the model's 4 experts"):
        validate_layout_for_launch(cfg(ep=3), world_size=3)
    with pytest.raises(RecipeError, match="micro_batch_size x data-parallel size = 4 x 8"):
        validate_layout_for_launch(cfg(), world_size=8)
    packed = cfg()
    packed.schedule.pack_sequences = True  # packed rows are dealt to the DP ranks: no row-count rule
    validate_layout_for_launch(packed, world_size=8)
    budget = cfg()
    budget.schedule.max_tokens_per_micro_batch = 2048
    validate_layout_for_launch(budget, world_size=8)  # 16 rows over 8 DP ranks, micro-batch size from the budget
    with pytest.raises(RecipeError, match="mini_batch_size=16 must be a multiple of the data-parallel size 32"):
        validate_layout_for_launch(budget, world_size=32)
    # the expert layout against the world size (megatron/layout.py's rules): EP 4 x PP 2 needs 8 ranks
    with pytest.raises(RecipeError, match=r"parallelism \(tp=1, pp=2, vpp=1, ep=4, etp=None\) at world size 4 .*"
                                          r"ETP x EP x PP = 8"):
        validate_layout_for_launch(cfg(ep=4, pp=2), world_size=4)
    with pytest.raises(RecipeError, match=r"parallelism \(tp=2, pp=1, vpp=1, ep=2, etp=None\) at world size 2 .*"
                                          r"ETP x EP x PP = 4"):  # etp=None: ETP = TP
        validate_layout_for_launch(cfg(tp=2, ep=2), world_size=2)
    with pytest.raises(RecipeError, match="ETP=3 does not divide expert ffn size 16"):
        validate_layout_for_launch(cfg(etp=3), world_size=3)
    with pytest.raises(RecipeError, match="parallelism.sequence_parallel=false with tp=2"):
        validate_layout_for_launch(cfg(tp=2, sequence_parallel=False), world_size=2)


def test_launch_needs_the_model_config(tmp_path):
    def cfg(path, **extra):
        return build_dataclass(
            TrainConfig,
            {
                "model": {"path": str(path), **extra},
                "data": {"train": "t"},
                "retrieval": {"corpus": "c"},
                "algorithm": {"advantage": {"estimator": "gae"}},
            },
        )

    with pytest.raises(RecipeError, match=r"model.path: .*does not exist"):
        validate_layout_for_launch(cfg(tmp_path / "absent"), world_size=1)
    with pytest.raises(RecipeError, match=r"model.path: .*config.json not found"):
        validate_layout_for_launch(cfg(tmp_path), world_size=1)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(RecipeError, match=r"model.path: cannot use the HF config"):
        validate_layout_for_launch(cfg(tmp_path / "bad"), world_size=1)
    gpt2 = _hf_config(tmp_path / "gpt2", model_type="gpt2", num_attention_heads=4, num_hidden_layers=2)
    with pytest.raises(RecipeError, match=r"model.path: unsupported architecture model_type='gpt2'"):
        validate_layout_for_launch(cfg(gpt2), world_size=1)
    model = _hf_config(tmp_path / "model", **TINY_MOE)
    validate_layout_for_launch(cfg(model), world_size=1)
    with pytest.raises(RecipeError, match=r"model.critic_path: .*does not exist"):
        validate_layout_for_launch(cfg(model, critic_path=str(tmp_path / "no_critic")), world_size=1)
    dense = dict(TINY_MOE, model_type="qwen2")
    del dense["num_experts"]
    with pytest.raises(RecipeError, match="routing_replay=r3 needs an MoE model"):
        validate_layout_for_launch(build_dataclass(TrainConfig, {
            "model": {"path": str(_hf_config(tmp_path / "dense", **dense))}, "data": {"train": "t"},
            "retrieval": {"corpus": "c"}, "algorithm": {"routing_replay": "r3"}}), world_size=1)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_print_config_needs_no_world_size_or_model(recipe, monkeypatch, capsys):
    from sorl_megatron.train import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--config", str(recipe), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "algorithm:" in out and "checkpoints" in out


def test_launch_without_the_model_files_names_model_path(monkeypatch, capsys):
    from sorl_megatron.train import main

    monkeypatch.setenv("WORLD_SIZE", "8")
    assert main(["--config", str(GPU / "sorl_qwen2.5_7b_so_ppo.yaml"), "model.path=/no/such/model"]) == 2
    assert "model.path" in capsys.readouterr().err


# Shapes of the real models (config.json values that the layout checks read; no weights).
QWEN25_7B = dict(model_type="qwen2", num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28,
                 intermediate_size=18944, vocab_size=152064)
QWEN25_3B = dict(model_type="qwen2", num_attention_heads=16, num_key_value_heads=2, num_hidden_layers=36,
                 intermediate_size=11008, vocab_size=151936)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", num_attention_heads=32, num_key_value_heads=4, num_hidden_layers=48,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
                     vocab_size=151936)
QWEN3_235B_A22B = dict(model_type="qwen3_moe", num_attention_heads=64, num_key_value_heads=4, num_hidden_layers=94,
                       num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536, intermediate_size=12288,
                       vocab_size=151936, head_dim=128)
# config.json of deepseek-ai/DeepSeek-V3 and moonshotai/Moonlight-16B-A3B (model_type deepseek_v3)
DEEPSEEK_V3 = dict(model_type="deepseek_v3", num_attention_heads=128, num_key_value_heads=128, num_hidden_layers=61,
                   hidden_size=7168, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8,
                   topk_group=4, first_k_dense_replace=3, moe_intermediate_size=2048, intermediate_size=18432,
                   q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                   routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=1, vocab_size=129280,
                   max_position_embeddings=163840, rope_theta=10000.0,
                   rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
MOONLIGHT_16B_A3B = dict(model_type="deepseek_v3", num_attention_heads=16, num_key_value_heads=16, num_hidden_layers=27,
                         hidden_size=2048, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1,
                         topk_group=1, first_k_dense_replace=1, moe_intermediate_size=1408, intermediate_size=11264,
                         q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                         routed_scaling_factor=2.446, norm_topk_prob=True, vocab_size=163840,
                         max_position_embeddings=8192, rope_theta=50000.0)

# recipe -> (model shape, the world sizes its comment states)
GPU_LAUNCHES = {
    "search_r1_base.yaml": (QWEN25_7B, [8]),
    "sorl_qwen2.5_7b_base.yaml": (QWEN25_7B, [8]),
    "sorl_qwen2.5_7b_outcome_base.yaml": (QWEN25_7B, [8]),
    **{f"sorl_qwen2.5_7b_{loss}.yaml": (QWEN25_7B, [8]) for loss in (
        "ppo", "turn_ppo", "s_ppo", "so_ppo", "grpo", "gspo", "so_grpo", "sapo")},
    "sapo_qwen2.5_3b.yaml": (QWEN25_3B, [8]),
    "pvpo_qwen2.5_7b.yaml": (QWEN25_7B, [8, 16, 32]),
    "minirl_qwen3_30b_a3b_r3.yaml": (QWEN3_30B_A3B, [32]),
    "minirl_qwen3_235b_a22b_r3.yaml": (QWEN3_235B_A22B, [64, 128]),
    "minirl_moonlight_16b_a3b_r3.yaml": (MOONLIGHT_16B_A3B, [8]),
    "minirl_deepseek_v3_r3.yaml": (DEEPSEEK_V3, [128, 256]),
}


# Real config shapes of each architecture the bridge builds, with a valid layout and the
# impossible ones: (parallelism, world size, the error naming the recipe key to change).
LLAMA31_8B = dict(model_type="llama", num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32,
                  intermediate_size=14336, vocab_size=128256)
QWEN3_8B = dict(model_type="qwen3", num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=36,
                intermediate_size=12288, vocab_size=151936, head_dim=128)
MIXTRAL_8X7B = dict(model_type="mixtral", num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32,
                    num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336, vocab_size=32000)
DENSE_BAD = [
    (dict(tp=8), 8, r"parallelism.tp=8 does not divide the model's \d+ attention / \d+ KV heads"),
    (dict(pp=5), 5, r"parallelism.pp x vpp = 5 does not divide the model's \d+ layers"),
    (dict(pp=2, vpp=5), 2, r"parallelism.pp x vpp = 10 does not divide"),
    (dict(tp=2), 3, r"parallelism: tp x pp = 2 x 1 = 2 does not divide the world size 3"),
    (dict(ep=2), 2, r"parallelism.ep=2 needs an MoE model; model.path is dense"),
    (dict(etp=2), 2, r"parallelism.etp=2: .*given for dense model"),
]
MOE_BAD = [
    (dict(tp=8), 8, r"parallelism.tp=8 does not divide the model's \d+ attention / \d+ KV heads"),
    (dict(pp=5), 5, r"parallelism.pp x vpp = 5 does not divide the model's \d+ layers"),
    (dict(ep=3), 3, r"parallelism.ep=3 does not divide the model's \d+ experts"),
    (dict(tp=2, ep=8, etp=1, pp=2), 8, r"parallelism.ep=8, parallelism.etp=1: .*ETP x EP x PP = 16"),
    (dict(tp=2, ep=2), 2, r"parallelism.ep=2, parallelism.etp=None: .*ETP x EP x PP = 4"),
    (dict(etp=5, ep=1), 5, r"parallelism.etp=5: .*ETP=5 does not divide expert ffn size"),
    (dict(tp=2, sequence_parallel=False), 2, r"parallelism.sequence_parallel=false with tp=2"),
]
ARCHITECTURES = {  # model_type -> (shape, a valid layout at a world size, impossible layouts)
    "qwen2": (QWEN25_7B, (dict(tp=4, pp=2), 16), DENSE_BAD),
    "llama": (LLAMA31_8B, (dict(tp=8, pp=4, vpp=2), 64), DENSE_BAD[1:]),  # tp=8 divides its 8 KV heads
    "qwen3": (QWEN3_8B, (dict(tp=8, pp=2, vpp=3), 32), DENSE_BAD[1:]),
    "qwen3_moe": (QWEN3_30B_A3B, (dict(tp=4, pp=2, ep=8, etp=1), 32), MOE_BAD[1:] + [
        (dict(tp=8), 8, r"parallelism.tp=8 does not divide the model's 32 attention / 4 KV heads")]),
    "mixtral": (MIXTRAL_8X7B, (dict(tp=4, pp=4, vpp=2, ep=8, etp=1), 32), MOE_BAD[1:] + [
        (dict(ep=16), 16, r"parallelism.ep=16 does not divide the model's 8 experts"),
        (dict(etp=3), 3, r"parallelism.etp=3: .*ETP=3 does not divide expert ffn size 14336")]),
}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_launch_checks_reject_impossible_layouts_of_each_architecture_naming_the_key(arch, tmp_path):
    from sorl_megatron.bridge.layout import SUPPORTED_MODEL_TYPES

    assert set(SUPPORTED_MODEL_TYPES) <= set(ARCHITECTURES) | {"deepseek_v3", "qwen2_moe", "glm4_moe"}
    shape, (good, good_world), bad = ARCHITECTURES[arch]
    model = _hf_config(tmp_path / "model", **shape)

    def cfg(**par):
        return build_dataclass(TrainConfig, {"model": {"path": str(model)}, "parallelism": par, "data": {"train": "t"},
                                             "retrieval": {"corpus": "c"},
                                             "schedule": {"batch_size": 128, "mini_batch_size": 512,
                                                          "micro_batch_size": 1}})

    validate_layout_for_launch(cfg(**good), good_world)
    for par, world, message in bad:
        with pytest.raises(RecipeError, match=message):
            validate_layout_for_launch(cfg(**par), world)


def test_every_gpu_recipe_is_covered():
    assert sorted(GPU_LAUNCHES) == sorted(p.name for p in GPU.glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(GPU_LAUNCHES))
def test_gpu_recipes_fit_their_stated_world_sizes(name, tmp_path):
    shape, world_sizes = GPU_LAUNCHES[name]
    model = _hf_config(tmp_path / "model", **shape)
    cfg = load_recipe(GPU / name, [f"model.path={model}"])
    for world_size in world_sizes:
        assert f"{world_size} GPUs" in (GPU / name).read_text() or name == "pvpo_qwen2.5_7b.yaml"
        validate_layout_for_launch(cfg, world_size)


def test_minirl_layout_needs_16_gpus(tmp_path):
    model = _hf_config(tmp_path / "model", **QWEN3_30B_A3B)
    cfg = load_recipe(GPU / "minirl_qwen3_30b_a3b_r3.yaml", [f"model.path={model}"])
    assert cfg.rollout.precision == "fp8" and cfg.algorithm.routing_replay == "r3"
    with pytest.raises(
        RecipeError, match=r"parallelism \(tp=2, pp=2, vpp=1, ep=8, etp=1\) at world size 8 .*ETP x EP x PP = 16"
    ):
        validate_layout_for_launch(cfg, 8)


def test_qwen3_235b_layout_is_the_only_kind_its_shape_allows(tmp_path):
    model = _hf_config(tmp_path / "model", **QWEN3_235B_A22B)
    cfg = load_recipe(GPU / "minirl_qwen3_235b_a22b_r3.yaml", [f"model.path={model}"])
    assert (cfg.model.dtype, cfg.rollout.precision, cfg.algorithm.routing_replay) == ("bfloat16", "fp8", "r3")
    assert cfg.optimizer.use_distributed_optimizer
    for overrides, world, message in [
        (["parallelism.tp=8"], 128, r"parallelism.tp=8 does not divide the model's 64 attention / 4 KV heads"),
        (["parallelism.pp=4"], 128, r"parallelism.pp x vpp = 4 does not divide the model's 94 layers"),
        (["parallelism.pp=2", "parallelism.vpp=2"], 128, r"parallelism.pp x vpp = 4 does not divide"),
        ([], 32, r"parallelism.ep=32, parallelism.etp=1: .*ETP x EP x PP = 64"),
    ]:
        with pytest.raises(RecipeError, match=message):
            validate_layout_for_launch(load_recipe(GPU / "minirl_qwen3_235b_a22b_r3.yaml",
                                                   [f"model.path={model}", *overrides]), world)


def test_deepseek_v3_layout_is_valid_through_its_uneven_stages(tmp_path):
    """61 layers are prime: the recipe's PP 4 works only because parallelism.first_stage_layers
    makes the stages 16 + 15 + 15 + 15; every even or interleaved variant is refused naming the key."""
    model = _hf_config(tmp_path / "model", **DEEPSEEK_V3)
    recipe = GPU / "minirl_deepseek_v3_r3.yaml"
    cfg = load_recipe(recipe, [f"model.path={model}"])
    assert (cfg.model.dtype, cfg.rollout.precision, cfg.algorithm.routing_replay) == ("bfloat16", "fp8", "r3")
    assert cfg.optimizer.use_distributed_optimizer and cfg.schedule.pack_sequences
    assert cfg.parallelism.stage_layers(61) == [16, 15, 15, 15]
    validate_layout_for_launch(cfg, 128)
    for overrides, world, message in [
        (["parallelism.first_stage_layers=null"], 128,
         r"parallelism.pp x vpp = 4 does not divide the model's 61 layers .*parallelism.first_stage_layers"),
        (["parallelism.first_stage_layers=14"], 128,
         r"parallelism.first_stage_layers=14, parallelism.pp=4: .*the 47 layers left by first_stage_layers=14 "
         r"do not split evenly over the 3 middle"),
        (["parallelism.last_stage_layers=16"], 128,
         r"parallelism.first_stage_layers=16, parallelism.last_stage_layers=16, parallelism.pp=4: .*29 layers"),
        (["parallelism.vpp=2"], 128, r"parallelism.vpp=2, parallelism.first_stage_layers=16: .*VPP=2 does not divide"),
        (["parallelism.pp=1"], 128, r"parallelism.first_stage_layers=16 needs parallelism.pp > 1"),
        (["parallelism.first_stage_layers=0"], 128, r"parallelism.first_stage_layers must be >= 1, got 0"),
        ([], 64, r"parallelism.ep=32, parallelism.etp=1: .*ETP x EP x PP = 128"),
    ]:
        with pytest.raises(RecipeError, match=message):
            validate_layout_for_launch(load_recipe(recipe, [f"model.path={model}", *overrides]), world)


def test_moonlight_recipe_is_one_node_of_deepseek_v3_architecture(tmp_path):
    model = _hf_config(tmp_path / "model", **MOONLIGHT_16B_A3B)
    cfg = load_recipe(GPU / "minirl_moonlight_16b_a3b_r3.yaml", [f"model.path={model}"])
    assert (cfg.model.dtype, cfg.rollout.precision, cfg.algorithm.routing_replay) == ("bfloat16", "fp8", "r3")
    assert cfg.rollout.weight_sync.transport == "distributed" and cfg.schedule.pack_sequences
    validate_layout_for_launch(cfg, 8)
    with pytest.raises(RecipeError, match=r"parallelism.ep=8, parallelism.etp=1: .*ETP x EP x PP = 8"):
        validate_layout_for_launch(cfg, 4)  # one node is the least: EP 8 needs 8 ranks


def test_gpu_recipe_paper_settings():
    for name in ("sorl_qwen2.5_7b_so_ppo.yaml", "sorl_qwen2.5_7b_so_grpo.yaml"):
        sorl = load_recipe(GPU / name)
        s = sorl.schedule
        optimizer_steps_per_rl_step = s.batch_size * sorl.rollout.group_size // s.mini_batch_size * s.ppo_epochs
        assert optimizer_steps_per_rl_step == 2
        # A.4's 4 epochs of NQ + HotpotQA (169,615 training rows) at 512 prompts a step, last partial batch dropped
        assert s.batch_size == 512 and s.total_steps == 4 * (169_615 // 512) == 1324
        # SORL A.4 warm-up ratios 0.285 (policy) / 0.015 (critic) of the RL steps, in optimizer steps
        assert sorl.optimizer.warmup_steps == int(0.285 * s.total_steps) * optimizer_steps_per_rl_step
        assert sorl.optimizer.critic_warmup_steps == int(0.015 * s.total_steps) * optimizer_steps_per_rl_step
        assert sorl.rollout.max_turns == 3 and sorl.optimizer.lr == 1e-6 and sorl.optimizer.critic_lr == 1e-5
        loss = sorl.algorithm.loss
        assert (loss.eps_low, loss.kl_coef) == (0.2, 0.001)
        assert (loss.clip_bias.mode, loss.clip_bias.delta) == ("param_grad", 1.0)
    pvpo = load_recipe(GPU / "pvpo_qwen2.5_7b.yaml")
    assert pvpo.schedule.total_steps == 1439 and pvpo.rollout.max_total_tokens - pvpo.data.max_prompt_tokens == 8192
    for path in GPU.glob("*.yaml"):
        cfg = load_recipe(path)
        # SGLang's distributed update, and packed sequences where trajectories are long-tailed
        assert cfg.rollout.weight_sync.transport == "distributed" and cfg.schedule.pack_sequences, path


STUDY_LOSSES = ("ppo", "turn_ppo", "s_ppo", "so_ppo", "grpo", "gspo", "so_grpo", "sapo")


@pytest.mark.parametrize("loss", STUDY_LOSSES)
def test_sorl_study_recipes_differ_from_their_base_only_by_the_loss(loss):
    import yaml

    cfg = load_recipe(GPU / f"sorl_qwen2.5_7b_{loss}.yaml")
    critic = POLICY_LOSSES[loss].critic
    base = load_recipe(GPU / ("sorl_qwen2.5_7b_base.yaml" if critic else "sorl_qwen2.5_7b_outcome_base.yaml"))
    assert cfg.algorithm.loss.name == loss and (cfg.algorithm.advantage.estimator == "gae") == critic

    def rest(c):
        tree = yaml.safe_load(dump_config(c))
        del tree["algorithm"]["loss"], tree["logging"]["run_name"], tree["checkpoint"]["dir"]
        return tree

    assert rest(cfg) == rest(base)
    assert cfg.logging.run_name == f"sorl_qwen2.5_7b_{loss}"
    # the two families share A.4's settings; they differ by the estimator and the group geometry
    family = rest(load_recipe(GPU / "sorl_qwen2.5_7b_base.yaml"))
    other = rest(load_recipe(GPU / "sorl_qwen2.5_7b_outcome_base.yaml"))
    for tree in (family, other):
        del tree["algorithm"]["advantage"]["estimator"], tree["rollout"]["group_size"]
        del tree["schedule"]["mini_batch_size"]
    assert family == other


def test_pvpo_static_v_refresh_schedule():
    from sorl_megatron.trainer.recipe.config import PVPOConfig

    due = lambda cfg: [k for k in range(1, 12) if cfg.refresh_due(k)]  # noqa: E731
    assert due(PVPOConfig()) == [] and not PVPOConfig(refresh_every=1).refresh_due(0)
    assert due(PVPOConfig(refresh_every=5)) == [5, 10]
    assert due(PVPOConfig(refresh_at=[3, 7])) == [3, 7]
    assert due(PVPOConfig(refresh_every=5, refresh_at=[3])) == [3, 5, 10]
    # the PVPO recipe refreshes once, at table 2's step 500
    pvpo = load_recipe(GPU / "pvpo_qwen2.5_7b.yaml").algorithm.pvpo
    assert [k for k in range(1, 1440) if pvpo.refresh_due(k)] == [500]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["algorithm.loss.name=so_ppo", "algorithm.advantage.estimator=grpo"],
         r"algorithm.loss.name=so_ppo is defined on a critic's advantages \(gae\) but "
         r"algorithm.advantage.estimator=grpo has no critic"),
        (["algorithm.loss.name=grpo", "algorithm.advantage.estimator=gae"],
         r"algorithm.loss.name=grpo is defined on outcome-based advantages but "
         r"algorithm.advantage.estimator=gae needs a critic: use algorithm.advantage.estimator in \['grpo', 'pvpo'\]"),
        (["algorithm.advantage.estimator=vtrace"],
         r"unknown estimator 'vtrace'; registered: \['gae', 'grpo', 'pvpo'\]"),
    ],
)
def test_a_loss_needs_an_estimator_it_can_use(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(BASE, overrides)


def test_the_optimizer_section_is_the_engines_optimizer_config():
    from sorl_megatron.engine.config import OptimConfig

    cfg = load_recipe(BASE, ["optimizer.lr_schedule=cosine", "optimizer.warmup_steps=2", "optimizer.critic_lr=1e-4",
                             "optimizer.critic_warmup_steps=1", "optimizer.use_distributed_optimizer=true"])
    assert isinstance(cfg.optimizer, OptimConfig)
    actor, critic = cfg.optimizer.actor(40), cfg.optimizer.critic(20)
    assert type(actor) is OptimConfig and actor.decay_steps == 40 and actor.lr == cfg.optimizer.lr
    assert actor.use_distributed_optimizer and actor.lr_schedule == "cosine" and actor.warmup_steps == 2
    assert (critic.lr, critic.warmup_steps, critic.decay_steps) == (1e-4, 1, 20)
    assert load_recipe(BASE, ["optimizer.decay_steps=7"]).optimizer.actor(40).decay_steps == 7
    assert load_recipe(BASE).optimizer.actor(40).decay_steps is None  # constant: nothing decays


def test_the_sft_engine_micro_batches_by_its_own_keys_else_the_schedules():
    from sorl_megatron.engine.config import BatchingConfig

    cfg = load_recipe(BASE, ["sft.micro_batch_size=null", "sft.pack_sequences=null", "schedule.pack_sequences=true",
                             "schedule.micro_batch_size=4"])
    assert cfg.sft.batching(cfg.schedule) == BatchingConfig(mini_batch_size=cfg.sft.batch_size, micro_batch_size=4,
                                                            pack_sequences=True)
    own = load_recipe(BASE, ["sft.micro_batch_size=16", "sft.pack_sequences=false", "schedule.pack_sequences=true"])
    assert own.sft.batching(own.schedule) == BatchingConfig(mini_batch_size=16, micro_batch_size=16,
                                                            pack_sequences=False)
    # packed rows need no divisibility: any micro-batch size packs the batch
    load_recipe(BASE, ["sft.micro_batch_size=3", "sft.pack_sequences=true"])


@pytest.mark.parametrize(
    "override,message",
    [
        ("optimizer.lr=.nan", r"optimizer.lr must be finite, got nan"),
        ("optimizer.lr=.inf", r"optimizer.lr must be finite, got inf"),
        ("optimizer.clip_grad=-5", r"optimizer.clip_grad must be >= 0 \(0 = off\), got -5"),
        ("optimizer.weight_decay=-1", r"optimizer.weight_decay must be >= 0, got -1"),
        ("optimizer.adam_beta1=2", r"optimizer.adam_beta1/adam_beta2 must be in \[0, 1\), got 2"),
        ("optimizer.min_lr=1", r"optimizer.min_lr must be in \[0, lr\], got 1"),
        ("optimizer.critic_lr=.nan", r"optimizer.critic_lr must be finite and > 0, got nan"),
        ("optimizer.critic_warmup_steps=-1", r"optimizer.critic_warmup_steps must be >= 0"),
    ],
)
def test_optimizer_values_are_checked_by_the_one_config(override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(BASE, [override])


def test_parallelism_is_the_engines_layout():
    from sorl_megatron.bridge.layout import ParallelLayout

    cfg = load_recipe(BASE, ["parallelism.tp=2", "parallelism.etp=1"])
    assert type(cfg.parallelism) is ParallelLayout and cfg.parallelism.expert_tp == 1


def test_defaults_may_name_recipes_with_dots(tmp_path):
    (tmp_path / "qwen2.5_base.yaml").write_text(BASE.read_text())
    (tmp_path / "top.yaml").write_text("defaults: [qwen2.5_base]\nschedule:\n  total_steps: 3\n")
    assert load_recipe(tmp_path / "top.yaml").schedule.total_steps == 3


def test_weight_sync_defaults_to_distributed():
    r = load_recipe(BASE, []).rollout
    w = r.weight_sync
    assert (w.transport, w.bucket_mb, w.timeout_s, w.init_timeout_s, w.master_address) == (
        "distributed", 512, 600.0, 120.0, None)


def test_process_group_bounds_are_recipe_keys_and_not_the_layout():
    """``parallelism.collective_timeout_s`` / ``rank0_phase_timeout_s`` ride on the layout
    section but are not the layout: equal layouts with other timeouts are equal."""
    cfg = load_recipe(BASE, ["parallelism.collective_timeout_s=42", "parallelism.rank0_phase_timeout_s=43"])
    assert (cfg.parallelism.collective_timeout_s, cfg.parallelism.rank0_phase_timeout_s) == (42, 43)
    assert cfg.parallelism == load_recipe(BASE, []).parallelism
    assert "collective_timeout_s: 42" in dump_config(cfg)


def test_validation_sample_is_fixed_and_capped():
    from sorl_megatron.trainer.rl_loop import validation_sample

    assert validation_sample(5, 0) == [0, 1, 2, 3, 4] and validation_sample(5, 9) == [0, 1, 2, 3, 4]
    sample = validation_sample(1000, 10)
    assert len(sample) == 10 == len(set(sample)) and sample == sorted(sample) and sample == validation_sample(1000, 10)
    assert sample != list(range(10))  # spread over the split, not its head


def test_the_cpu_recipes_checkpoint_sft_often_enough_to_lose_little():
    """Issue 48: at 200 steps between SFT checkpoints a Ctrl-C on a slow machine lost up to 15
    minutes of the demo's SFT; the CPU recipes keep one every 100 steps at most."""
    for recipe in sorted(BASE.parent.glob("tiny_search_*.yaml")):
        cfg = load_recipe(recipe)
        if cfg.sft.enabled:
            assert 0 < cfg.sft.save_every <= 100, f"{recipe.name}: sft.save_every={cfg.sft.save_every}"
