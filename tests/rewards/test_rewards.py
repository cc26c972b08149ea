import pytest

from sorl_megatron.rewards import (
    QAReward,
    RewardRegistry,
    compute_score,
    exact_match,
    extract_answer,
    is_well_formed,
    multiple_choice,
    normalize_answer,
    token_f1,
)


@pytest.mark.parametrize(
    "raw,norm",
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  an   apple, a day ", "apple day"),
        ("Theatre of the Absurd", "theatre of absurd"),  # 'the' inside a word stays
        ("U.S.A.", "usa"),
        ("", ""),
    ],
)
def test_normalize(raw, norm):
    assert normalize_answer(raw) == norm


def test_exact_match_articles_punctuation_and_aliases():
    assert exact_match("the Beatles.", ["Beatles"]) == 1.0
    assert exact_match("Paris", ["London", "paris, "]) == 1.0
    assert exact_match("Paris France", ["Paris"]) == 0.0
    assert exact_match("An Apple", "apple") == 1.0
    with pytest.raises(ValueError):
        exact_match("x", [])


def test_token_f1_values():
    assert token_f1("Barack Obama", ["Obama"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    # best over targets
    assert token_f1("new york city", ["york", "New York City"]) == 1.0
    assert token_f1("the", ["a"]) == 0.0  # both normalize to empty
    assert token_f1("red red blue", ["red blue green"]) == pytest.approx(2 * (2 / 3) * (2 / 3) / (4 / 3))


def test_extract_answer_takes_last_block():
    text = "<think>x</think><answer> first </answer> more <answer>Second</answer>"
    assert extract_answer(text) == "Second"
    assert extract_answer("no answer here") is None
    assert extract_answer("<answer>multi\nline</answer>") == "multi\nline"


def test_multiple_choice_letter():
    assert multiple_choice("B", ["b"]) == 1.0
    assert multiple_choice("(C) aspirin", ["C"]) == 1.0
    assert multiple_choice("answer: D", ["C"]) == 0.0
    assert multiple_choice("none", ["A"]) == 0.0


def test_format_check():
    good = ["<think>a</think>\n<search>q</search>", "<think>b</think>\n<answer>x</answer>"]  # the policy's turns
    assert is_well_formed(good) and is_well_formed("<answer>x</answer>")
    # the observations are not the policy's: a response text that includes them is not its turns
    assert not is_well_formed("<search>q</search>\n<information>d</information>\n<answer>x</answer>")
    assert not is_well_formed("<answer>x</answer><answer>y</answer>")
    assert not is_well_formed("<think><search>q</search></think><answer>x</answer>")
    assert not is_well_formed("<search>q</search>")
    assert not is_well_formed("<answer>x")


def test_registry_by_data_source():
    reg = RewardRegistry()
    gt = {"target": ["Paris", "City of Light"]}
    assert reg.score("nq", "<answer>the city of light</answer>", gt) == 1.0
    assert reg.score("hotpotqa", "<answer>paris france</answer>", gt) == 0.0
    assert reg.score("medqa", "<answer>B</answer>", {"target": ["B"]}) == 1.0
    assert reg.score("nq", "Paris", gt) == 0.0  # no answer block
    f1 = RewardRegistry(metric_override="f1")
    assert f1.score("nq", "<answer>paris france</answer>", gt) == pytest.approx(2 / 3)
    with pytest.raises(KeyError, match="unknown_src"):
        reg.get("unknown_src")
    assert RewardRegistry(default="em").score("unknown_src", "<answer>x</answer>", ["x"]) == 1.0
    reg.register("custom", lambda resp, gt: 0.5)
    assert reg.score("custom", "", None) == 0.5
    assert compute_score("nq", "<answer>Paris</answer>", gt) == 1.0


def test_format_weight_mixes_structure():
    r = QAReward(metric="em", format_weight=0.2)
    assert r("<answer>wrong</answer>", ["x"]) == pytest.approx(0.2)
    assert r("<answer>x</answer>", ["x"]) == pytest.approx(1.0)
    assert r("<answer>x</answer><search>q</search>", ["x"]) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="format_weight"):
        QAReward(format_weight=2.0)
    with pytest.raises(KeyError, match="target"):
        r("<answer>x</answer>", {"answers": ["x"]})
