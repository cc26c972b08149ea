"""Rule rewards for question answering (Search-R1 conventions).

Rewards read only what the policy wrote: a response is the list of the policy's own turn
texts (``Trajectory.turn_texts``, the decoded loss-mask-1 spans), never the observations or
messages the environment put between them; a bare string is one policy turn. A retrieved
passage or an environment message that shows ``<answer>X</answer>`` can therefore never be
taken for the policy's answer.

Answers are read from the policy's last ``<answer>...</answer>`` block and compared with
every target after SQuAD normalization (lower-case, no punctuation, no articles a/an/the,
single spaces). A prediction scores the best value over all targets (aliases); an answer
that normalizes to nothing scores 0.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence

# What a reward reads: the policy's turn texts in order, or one string (a single turn).
PolicyResponse = str | Sequence[str]

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT_TABLE = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lower-case, strip punctuation and articles, collapse spaces."""
    text = text.lower().translate(_PUNCT_TABLE)
    text = _ARTICLES_RE.sub(" ", text)
    return " ".join(text.split())


def policy_turns(response: PolicyResponse) -> list[str]:
    """The policy's turn texts of a response (a string is one turn)."""
    if isinstance(response, str):
        return [response]
    turns = list(response)
    if not all(isinstance(t, str) for t in turns):
        raise TypeError(f"a response is a string or a list of the policy's turn texts, got {response!r:.200}")
    return turns


def extract_answer(response: PolicyResponse) -> str | None:
    """The content of the policy's last ``<answer>`` block, or None when there is none.

    A block must open and close inside one policy turn: an ``<answer>`` cut off by a turn's
    token budget and a ``</answer>`` in a later turn are not an answer.
    """
    for turn in reversed(policy_turns(response)):
        matches = _ANSWER_RE.findall(turn)
        if matches:
            return matches[-1].strip()
    return None


def _targets(targets: str | Iterable[str]) -> list[str]:
    if isinstance(targets, str):
        return [targets]
    out = [str(t) for t in targets]
    if not out:
        raise ValueError("no ground-truth targets given")
    return out


def exact_match(prediction: str, targets: str | Iterable[str]) -> float:
    """1.0 if the normalized prediction equals any normalized target, else 0.0.

    An empty normalized prediction never matches (an empty target must not reward silence).
    """
    golds = [normalize_answer(t) for t in _targets(targets)]
    pred = normalize_answer(prediction)
    return float(bool(pred) and pred in golds)


def _f1(pred_tokens: Sequence[str], gold_tokens: Sequence[str]) -> float:
    common = Counter(pred_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, targets: str | Iterable[str]) -> float:
    """Best SQuAD token F1 of the prediction over all targets."""
    pred = normalize_answer(prediction).split()
    return max(_f1(pred, normalize_answer(t).split()) for t in _targets(targets))


def substring_match(prediction: str, targets: str | Iterable[str]) -> float:
    """1.0 if any normalized target occurs inside the normalized prediction (cover EM)."""
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(t) in pred for t in _targets(targets) if normalize_answer(t)))


_LETTER_RE = re.compile(r"\b([A-Z])\b")


def choice_letter(answer: str) -> str | None:
    """The option letter in an answer such as ``B``, ``(B)``, ``B. aspirin`` or ``answer: B``."""
    text = answer.strip()
    if len(text) == 1 and text.isalpha():
        return text.upper()
    m = _LETTER_RE.search(text)
    return m.group(1) if m else None


def multiple_choice(prediction: str, targets: str | Iterable[str]) -> float:
    """1.0 if the predicted option letter equals the target letter (case-insensitive)."""
    letter = choice_letter(prediction)
    if letter is None:
        return 0.0
    return float(any(letter == t.strip().upper()[:1] for t in _targets(targets) if t.strip()))


_TAG_RE = re.compile(r"<(think|search|answer|information)>|</(think|search|answer|information)>")
# Tags of the agent protocol that the policy writes (``information`` is the environment's).
ACTION_TAGS = ("think", "search", "answer")
ACTION_TAG_RE = re.compile(r"</?(think|search|answer)>")


def _turn_actions(turn: str) -> list[str] | None:
    """The actions (``search`` / ``answer``) closed in one policy turn, in order, or None when
    its tags are unbalanced, nested, an ``<information>`` block (the environment's tag: a
    policy that writes it fakes an observation) or followed by more tags after an action."""
    open_tag: str | None = None
    actions: list[str] = []
    for m in _TAG_RE.finditer(turn):
        tag = m.group(1) or m.group(2)
        if tag == "information" or actions:
            return None  # an observation written by the policy, or a tag after its action
        if m.group(1):
            if open_tag is not None:
                return None
            open_tag = tag
        else:
            if open_tag != tag:
                return None
            if tag != "think":
                actions.append(tag)
            open_tag = None
    return None if open_tag is not None else actions


def is_well_formed(response: PolicyResponse) -> bool:
    """Structural check of the policy's turns (the observations between them are not read).

    Every turn has balanced, unnested tags and exactly one action, closed last: each turn
    but the last is a ``<search>``, the last turn is the one ``<answer>``. A turn without a
    valid action (it drew the environment's correction message) makes the episode malformed.
    """
    turns = policy_turns(response)
    if not turns:
        return False
    for i, turn in enumerate(turns):
        if _turn_actions(turn) != ["answer" if i == len(turns) - 1 else "search"]:
            return False
    return True
