"""The study runner's quick variant: two losses x one stress level x one seed, one RL step each,
from a tiny random policy; then a re-run skips the finished cells and rewrites the summary."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sorl_megatron.common.typed_config import ConfigError
from sorl_megatron.study.runner import Cell, cell_statistics, load_study, main, run_table

ROOT = Path(__file__).resolve().parents[1]


def test_cell_statistics_and_the_collapse_rule():
    rows = [{"step": 0, "val/em": 0.4}, {"step": 4, "val/em": 0.6, "actor/grad_norm": 2.0},
            {"step": 8, "val/em": 0.2, "actor/approx_kl_k3": 0.3}, {"step": 12, "val/em": 0.5}]
    s = cell_statistics(rows, 0.5)
    assert (s["final_em"], s["best_em"], s["max_kl"], s["max_grad_norm"], s["collapsed"]) == (0.5, 0.6, 0.3, 2.0, 1.0)
    assert s["em_auc"] == pytest.approx((4 * 0.5 + 4 * 0.4 + 4 * 0.35) / 12)
    assert cell_statistics(rows, 0.3)["collapsed"] == 0.0  # 0.2 is not below 0.3 x 0.6
    assert cell_statistics([{"step": 0, "val/em": 0.0}, {"step": 4, "val/em": 0.0}], 0.5)["collapsed"] == 0.0
    # best EM after step 0 (docs/study.md): the starting policy's EM is not a loss's result
    s = cell_statistics([{"step": 0, "val/em": 0.44}, {"step": 4, "val/em": 0.1}, {"step": 8, "val/em": 0.2}], 0.5)
    assert (s["best_em"], s["final_em"]) == (0.2, 0.2)
    assert "best_em" not in cell_statistics([{"step": 0, "val/em": 0.44}], 0.5)


def test_the_run_table_lists_every_run_seed_by_seed():
    rows = [{"step": 0, "val/em": 0.4375}, {"step": 1, "actor/approx_kl_k3": 0.02, "actor/clip_frac": 0.1,
             "actor/clip_bias/factor": 0.8}, {"step": 2, "actor/approx_kl_k3": 1.5, "actor/clip_frac": 0.3,
             "actor/clip_bias/factor": 1.0, "val/em": 0.1}]
    rows[1].update({"mismatch/kl_k3": 0.5, "actor/grad_norm": 2.0})
    rows[2].update({"mismatch/kl_k3": 0.02, "actor/grad_norm": 594.4})
    rows[0]["mismatch/kl_k3"] = 0.01
    lines = run_table({Cell("so_grpo", "high", 2): rows, Cell("grpo", "low", 1): [{"step": 0}]})
    assert lines[-2] == "| so_grpo, high, 2 | 0.438 / 0.100 (steps 0, 2) | 0.02 (0.5) | 1.5 | 0.3 | 594 | 0.80-1.00 |"
    assert lines[-1] == "| grpo, low, 1 | - | - | - | - | - | - |"


def test_bad_study_recipes_name_the_key(tmp_path):
    from sorl_megatron.common.typed_config import ConfigError

    path = tmp_path / "s.yaml"
    path.write_text("recipe: x.yaml\nstart_policy: p\nlosses: {a: []}\nstress: {b: []}\nparalel: 2\n")
    with pytest.raises(ConfigError, match=r"study.paralel \(did you mean study.parallel\?\)"):
        load_study(path)
    path.write_text("recipe: x.yaml\nstart_policy: p\nlosses: {}\nstress: {b: []}\n")
    with pytest.raises(ConfigError, match="losses, stress and seeds must each name at least one entry"):
        load_study(path)


def test_a_study_recipes_counts_waits_and_names_are_bounded(tmp_path):
    """parallel, stop_timeout_s and the cell names (run directories, run names) have maxima."""
    from sorl_megatron.common.typed_config import ConfigError

    path = tmp_path / "s.yaml"
    base = "recipe: x.yaml\nstart_policy: p\nlosses: {a: []}\nstress: {b: []}\n"
    for extra, message in [("parallel: 100000\n", r"parallel must be in \[1, 1024\], got 100000"),
                           ("stop_timeout_s: 1.0e30\n", r"stop_timeout_s must be in \(0, 3600\] seconds"),
                           (f"losses: {{{'x' * 250}: []}}\n", r"a cell name .* is 257 bytes; at most 200")]:
        path.write_text(base.replace("losses: {a: []}\n", "") + extra if extra.startswith("losses") else base + extra)
        with pytest.raises((ConfigError, ValueError), match=message):
            load_study(path)


def test_a_typo_in_the_last_cell_fails_before_the_first_trains(tmp_path, monkeypatch):
    """The whole grid is loaded before any cell starts: a bad override in the second stress
    level used to train the first cell fully before the error."""
    import sorl_megatron.study.runner as study_mod
    from sorl_megatron.trainer.recipe.config import RecipeError

    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "config.json").write_text("{}")
    started = []
    monkeypatch.setattr(study_mod, "run_cell", lambda *a, **k: started.append(a) or (a[1], 0, "ran"))
    cfg = study_mod.StudyConfig(recipe=str(ROOT / "recipes" / "tiny_search_grpo.yaml"),
                                start_policy=str(tmp_path / "policy"), out=str(tmp_path / "out"),
                                losses={"grpo": []}, stress={"low": [], "high": ["schedule.ppo_epoch=3"]})
    with pytest.raises(RecipeError, match="schedule.ppo_epoch"):
        study_mod.run_study(cfg)
    assert started == []


def test_only_runs_a_subset_of_the_grid_and_each_cell_says_where_it_starts(tmp_path, monkeypatch, capsys):
    """Issue 48: the smallest shipped grid is 27 cells and overrides add to a grid; --only picks
    cells by name, and a cell says when it starts and whether it resumes (before, the study
    printed nothing while a cell trained)."""
    import sorl_megatron.study.runner as study_mod

    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "config.json").write_text("{}")
    cfg = study_mod.StudyConfig(recipe=str(ROOT / "recipes" / "tiny_search_grpo.yaml"),
                                start_policy=str(tmp_path / "policy"), out=str(tmp_path / "out"), seeds=[1, 2],
                                losses={"grpo": [], "so_grpo": ["algorithm.loss.name=so_grpo"]},
                                stress={"low": [], "high": ["schedule.ppo_epochs=2"]})
    assert [c.name for c in study_mod.selected_cells(cfg, ["grpo__*__s1"])] == ["grpo__low__s1", "grpo__high__s1"]
    assert len(study_mod.selected_cells(cfg)) == 8
    with pytest.raises(ConfigError, match=r"--only 'ppo__\*' matches no cell of the grid \(8 cells: grpo__low__s1"):
        study_mod.selected_cells(cfg, ["ppo__*"])

    class Done:  # the trainer's process, finished at once
        def wait(self):
            return 0

    monkeypatch.setattr(study_mod.subprocess, "Popen", lambda *a, **k: Done())
    results = study_mod.run_study(cfg, 1, ["so_grpo__high__s2"])
    assert [(c.name, code) for c, code, _ in results] == [("so_grpo__high__s2", 0)]
    out = capsys.readouterr().out
    run_dir = tmp_path / "out" / "runs" / "so_grpo__high__s2"
    assert (f"[study] so_grpo__high__s2: starting, RL starts from step 0 (no RL checkpoint yet) "
            f"(log: {run_dir / 'study.log'})") in out
    assert "grpo__low__s1" not in out


@pytest.mark.slow
def test_quick_study_runs_resumes_and_summarizes(tmp_path, capsys):
    data = tmp_path / "data"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'kernels'}")
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_synthetic_data.py"), "--out", str(data),
                    "--num-people", "8", "--make-model", "--vocab-size", "512", "--tie-embeddings"],
                   check=True, capture_output=True, env=env, cwd=ROOT)
    study = tmp_path / "study.yaml"
    study.write_text(f"""
recipe: {ROOT / 'recipes' / 'tiny_search_so_grpo.yaml'}
start_policy: {data / 'model'}
data: {data}
out: {tmp_path / 'out'}
seeds: [5]
losses:
  grpo: [algorithm.loss.name=grpo]
  so_grpo_relative: [algorithm.loss.name=so_grpo, algorithm.loss.clip_bias.form=relative]
stress:
  high: [schedule.mini_batch_size=8, schedule.ppo_epochs=2]
overrides: [schedule.total_steps=1, schedule.batch_size=2, rollout.group_size=4, schedule.micro_batch_size=4,
            schedule.val_every=1, rollout.max_turns=2, rollout.max_total_tokens=400, data.max_prompt_tokens=300]
""")
    assert main(["--config", str(study)]) == 0
    out = capsys.readouterr().out
    assert "grpo__high__s5: ran" in out and "so_grpo_relative__high__s5: ran" in out
    for cell in (Cell("grpo", "high", 5), Cell("so_grpo_relative", "high", 5)):
        assert (tmp_path / "out" / "runs" / cell.name / "metrics.jsonl").is_file()
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| grpo | 1 |" in summary and "| so_grpo_relative | 1 |" in summary and "0/1 |" in summary
    assert (tmp_path / "out" / "figures" / "val_em.png").is_file()
    # a second invocation finds both cells done and only rewrites the summary
    assert main(["--config", str(study)]) == 0
    assert capsys.readouterr().out.count("done before") == 2


def test_the_shipped_study_recipes_load():
    for path in sorted((ROOT / "recipes" / "study").glob("*.yaml")):
        cfg = load_study(path)
        # a reproduction check reruns one recorded cell; a grid that compares needs seeds
        assert Path(cfg.recipe).is_file() and len(cfg.seeds) >= (1 if path.stem.endswith("_repro") else 3), path
        for cell in [Cell(loss, stress, cfg.seeds[0]) for loss in cfg.losses for stress in cfg.stress]:
            from sorl_megatron.study.runner import cell_overrides
            from sorl_megatron.trainer.recipe.loader import load_recipe

            load_recipe(cfg.recipe, cell_overrides(cfg, cell, Path(cfg.out)))  # every cell validates


def test_studies_sharing_an_out_keep_their_own_summaries(tmp_path):
    """Round two's grids share one ``out`` (a cell two of them name runs once); each writes its own
    summary and figures, listing only its own cells."""
    import json

    from sorl_megatron.study.runner import StudyConfig, summarize

    out = tmp_path / "out"
    for name in ("grpo__control__s1", "ppo__control__s1"):
        (out / "runs" / name).mkdir(parents=True)
        rows = [{"step": s, "val/em": 0.5 + 0.01 * s, "actor/grad_norm": 1.0} for s in range(0, 5, 2)]
        (out / "runs" / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def study(loss: str, **kw) -> StudyConfig:
        return StudyConfig(recipe="r.yaml", start_policy="p", out=str(out), losses={loss: []},
                           stress={"control": []}, **kw)

    for loss in ("grpo", "ppo"):
        written = summarize(study(loss, summary=f"summary_{loss}.md", figures=f"figures/{loss}"))
        assert written == out / f"summary_{loss}.md"
    mine, theirs = (out / "summary_grpo.md").read_text(), (out / "summary_ppo.md").read_text()
    assert "| grpo | 1 |" in mine and "| ppo |" not in mine and "| ppo | 1 |" in theirs and "| grpo |" not in theirs
    assert "![val_em](figures/grpo/val_em.png)" in mine and (out / "figures" / "grpo" / "val_em.png").is_file()
    assert not (out / "summary.md").exists()
    for bad in ("../x.md", "/tmp/x.md", "runs/x.md", "", "notes.txt"):
        with pytest.raises(ValueError, match="summary must"):
            study("grpo", summary=bad)
    with pytest.raises(ValueError, match="figures must be a path inside out"):
        study("grpo", figures="runs")


def test_figures_draw_seed_bands_on_labelled_axes(tmp_path, monkeypatch):
    """Mean over seeds with a min-max band, EM on [0, 1] with its unit, whole-step ticks; no
    empty panels."""
    from matplotlib.figure import Figure

    from sorl_megatron.study.runner import StudyConfig, _figures

    figures, save = {}, Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, *a, **k: figures.update({Path(path).name: fig})
                        or save(fig, path, *a, **k))
    cfg = StudyConfig(recipe="r.yaml", start_policy="p", losses={"grpo": [], "so_grpo": []},
                      stress={"not_run": [], "high": []}, seeds=[1, 2])
    runs = {Cell(loss, "high", seed): [{"step": s, "val/em": 0.4 + 0.01 * s + 0.02 * seed + (loss == "grpo") * 0.1}
                                       for s in range(0, 13, 4)]
            for loss in cfg.losses for seed in cfg.seeds}
    written = _figures(cfg, runs, tmp_path)
    assert [p.name for p in written] == ["val_em.png"]
    [ax] = figures["val_em.png"].axes  # a stress level no run reached gets no panel
    assert ax.get_ylabel() == "exact match (fraction of questions)" and ax.get_xlabel() == "RL step"
    low, high = ax.get_ylim()
    assert low <= 0 and 1 <= high < 1.1 and all(float(t).is_integer() for t in ax.get_xticks())
    assert [line.get_label() for line in ax.get_lines()] == ["grpo (n=2)", "so_grpo (n=2)"]
    assert len(ax.collections) == 2  # one band per loss
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx([0.53 + 0.01 * s for s in range(0, 13, 4)])


def test_figures_mark_identical_losses_and_draw_no_band_for_one_seed(tmp_path, monkeypatch):
    """s_ppo equal to ppo seed for seed (the normalization never engaged) is named, each loss
    has its own line style and marker, one seed gets no band and a title that says so, the
    legend is beside the panels and ||C|| is explained under the figure."""
    from matplotlib.figure import Figure

    from sorl_megatron.study.runner import StudyConfig, _figures

    figures, save = {}, Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, *a, **k: figures.update({Path(path).name: fig})
                        or save(fig, path, *a, **k))
    cfg = StudyConfig(recipe="r.yaml", start_policy="p", losses={"ppo": [], "s_ppo": [], "grpo": []},
                      stress={"low": [], "high": []}, seeds=[1])

    def rows(loss, stress):
        shift = {"grpo": 0.2, "s_ppo": 0.1 if stress == "high" else 0.0}.get(loss, 0.0)
        return [{"step": s, "val/em": 0.4 + shift + 0.01 * s, "actor/clip_bias/logprob_norm": 0.05 + shift}
                for s in range(0, 13, 4)]

    runs = {Cell(loss, stress, 1): rows(loss, stress) for loss in cfg.losses for stress in cfg.stress}
    _figures(cfg, runs, tmp_path)
    fig = figures["val_em.png"]
    low, high = fig.axes
    assert low.get_title() == "stress: low\nidentical curves: s_ppo = ppo" and high.get_title() == "stress: high"
    assert list(low.get_xticks()) == [0, 4, 8, 12]
    assert len(low.collections) == 0  # n=1: no band
    assert fig._suptitle.get_text() == "validation exact match: one seed per loss, no band"
    assert len({(line.get_linestyle(), line.get_marker()) for line in low.get_lines()}) == 3
    assert fig.legends and low.get_legend() is None
    notes = " ".join(t.get_text() for t in figures["actor_clip_bias_logprob_norm.png"].texts)
    assert "||C||: norm of the clipping bias C" in notes


def test_the_record_keeps_what_the_summary_reads(tmp_path, capsys):
    """``--export`` cuts each run to the keys the summary, the figures and docs/study.md's tables
    read; summarizing the record gives the runs' summary, line for line; it never overwrites ``out``."""
    import json

    from sorl_megatron.common.typed_config import ConfigError
    from sorl_megatron.study.runner import StudyConfig, export_record, summarize

    out, dest = tmp_path / "out", tmp_path / "record"
    for name, fall in (("grpo__control__s1", 1.0), ("grpo__control__s2", 0.1), ("ppo__control__s1", 1.0)):
        em = [0.8374999761581421] + [min(0.8125, 0.5375 + 0.0125 * s) * (fall if s == 4 else 1) for s in range(2, 9, 2)]
        rows = [{"step": s, "val/em": em[s // 2],
                 "actor/grad_norm": 1.0 + s / 3, "mismatch/kl_k3": 2.7123456789e-13 * (1 + s),
                 "actor/approx_kl_k3": 0.0312345678 * s, "timing/step_s": 7.25, "actor/batching/tokens": 4096,
                 "actor/entropy/mean": float("nan") if s == 2 else 1.5 - s / 10}
                for s in range(0, 9, 2)] + [{"step": 9, "timing/save_s": 1.0}]
        (out / "runs" / name).mkdir(parents=True)
        (out / "runs" / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = StudyConfig(recipe="r.yaml", start_policy="p", out=str(out), losses={"grpo": [], "gspo": []},
                      stress={"control": []}, seeds=[1, 2, 3])
    written = export_record(cfg, dest)
    assert written == [dest / "runs" / f"grpo__control__s{s}" / "metrics.jsonl" for s in (1, 2)]  # ppo: not this grid
    record = [json.loads(line) for line in written[0].read_text().splitlines()]
    assert [r["step"] for r in record] == [0, 2, 4, 6, 8]  # a row with nothing kept is left out
    assert set(record[1]) == {"step", "val/em", "actor/grad_norm", "mismatch/kl_k3", "actor/approx_kl_k3",
                              "actor/entropy/mean"}
    assert record[1]["mismatch/kl_k3"] == 2.7123456789e-13 * 3 and record[1]["val/em"] == 0.5625  # as logged
    assert record[1]["actor/entropy/mean"] != record[1]["actor/entropy/mean"]  # NaN kept as logged
    made = summarize(cfg).read_text()
    assert "0.837 / 0.562" in made  # a float32 EM as the run logged it (0.8375 would print 0.838)
    cfg.out = str(dest)
    assert summarize(cfg).read_text() == made and "| grpo | 2 |" in made and "| 1/2 |" in made
    assert (dest / "figures" / "val_em.png").is_file()
    with pytest.raises(ConfigError, match="is the study's out"):
        export_record(cfg, dest)
    recipe = tmp_path / "study.yaml"
    recipe.write_text(f"recipe: r.yaml\nstart_policy: p\nout: {out}\nlosses: {{grpo: []}}\nstress: {{control: []}}\n"
                      "seeds: [1, 2, 3]\n")
    assert main(["--config", str(recipe), "--export", str(tmp_path / "again")]) == 0
    assert "[study] record: 2 of 3 runs written under" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("grid,record", [("round2_replay", "round2"), ("round2_corrections", "round2"),
                                         ("round2_turn", "round2"), ("round2_mechanism", "round2_mechanism")])
def test_the_committed_summaries_are_what_the_record_and_the_grid_give(grid, record, tmp_path):
    """``--summarize out=results/study/<record>`` (docs/study.md) rewrites the committed summary as it
    is: the study recipe's cells pass today's recipe schema, and its stress overrides (shown in the
    summary's headings) and the committed record give the committed summary. Summarized into a
    copy of the record, so the repository's files stay as they are."""
    import shutil

    from sorl_megatron.study.runner import cell_overrides, cells, summarize
    from sorl_megatron.trainer.recipe.loader import load_recipe

    shutil.copytree(ROOT / "results" / "study" / record / "runs", tmp_path / "runs")
    cfg = load_study(ROOT / "recipes" / "study" / f"{grid}.yaml", [f"out={tmp_path}"])
    for cell in cells(cfg):
        load_recipe(cfg.recipe, cell_overrides(cfg, cell, tmp_path))
    assert summarize(cfg).read_text() == (ROOT / "results" / "study" / record / cfg.summary).read_text()
