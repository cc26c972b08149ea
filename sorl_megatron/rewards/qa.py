"""Rule rewards for question answering (Search-R1 conventions).

Answers are read from the policy's last ``<answer>...</answer>`` block and compared with
every target after SQuAD normalization (lower-case, no punctuation, no articles a/an/the,
single spaces). A prediction scores the best value over all targets (aliases).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT_TABLE = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lower-case, strip punctuation and articles, collapse spaces."""
    text = text.lower().translate(_PUNCT_TABLE)
    text = _ARTICLES_RE.sub(" ", text)
    return " ".join(text.split())


def extract_answer(response: str) -> str | None:
    """The content of the last ``<answer>`` block, or None when there is none.

    The last block counts because Search-R1 prompts may themselves show the tag; the
    policy's own final answer comes last.
    """
    matches = _ANSWER_RE.findall(response)
    return matches[-1].strip() if matches else None


def _targets(targets: str | Iterable[str]) -> list[str]:
    if isinstance(targets, str):
        return [targets]
    out = [str(t) for t in targets]
    if not out:
        raise ValueError("no ground-truth targets given")
    return out


def exact_match(prediction: str, targets: str | Iterable[str]) -> float:
    """1.0 if the normalized prediction equals any normalized target, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(t) for t in _targets(targets)))


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


def is_well_formed(response: str) -> bool:
    """Structural check of a search-agent response.

    Tags are balanced and never nested, and the response ends with exactly one
    ``<answer>`` block as its last action.
    """
    open_tag: str | None = None
    answers = 0
    for m in _TAG_RE.finditer(response):
        if m.group(1):
            if open_tag is not None:
                return False
            open_tag = m.group(1)
        else:
            if open_tag != m.group(2):
                return False
            answers += open_tag == "answer"
            open_tag = None
    if open_tag is not None or answers != 1:
        return False
    tail = response[response.rfind("</answer>") + len("</answer>") :]
    return "<search>" not in tail
