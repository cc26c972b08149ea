"""A synthetic knowledge base for offline search-agent training and tests.

People are born in cities and work for companies; cities lie in countries; companies are
headquartered in cities. Each entity gets one passage (title line, then text) in a Search-R1
JSONL corpus. Questions are single-hop (one search) or two-hop (two chained searches), in the
verl / Search-R1 parquet schema, and every question carries its gold plan: the searches and
the answer an ideal agent would produce (SFT cold start, PVPO ground-truth injection).

    python -m sorl_megatron.data.synthetic --out data/synth --num-people 300 --make-model
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..common.cli_range import MAX_SEED, count
from .qa import QARow, make_row, write_parquet

_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ra",
    "to",
    "ve",
    "su",
    "ni",
    "do",
    "be",
    "ar",
    "el",
    "on",
    "ur",
    "is",
    "ta",
    "po",
    "ze",
]
OCCUPATIONS = ["painter", "engineer", "chemist", "poet", "architect", "pilot", "botanist", "composer"]


@dataclass
class KnowledgeBase:
    countries: list[str]
    cities: dict[str, str]  # city -> country
    companies: dict[str, str]  # company -> headquarters city
    people: dict[str, dict[str, str]]  # person -> {birth_city, employer, occupation}


@dataclass
class GoldPlan:
    """The ideal episode: one search per hop, then the answer."""

    searches: list[str]
    answer: str
    thoughts: list[str] = field(default_factory=list)

    def turns(self) -> list[str]:
        """The policy's text of each turn (Search-R1 action format)."""
        out = []
        for i, q in enumerate(self.searches):
            think = self.thoughts[i] if i < len(self.thoughts) else f"I need to find {q}."
            out.append(f"<think> {think} </think>\n<search> {q} </search>")
        out.append(f"<think> I have the answer. </think>\n<answer> {self.answer} </answer>")
        return out


def _name(rng: random.Random, used: set[str], parts: int) -> str:
    while True:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()
        if name not in used:
            used.add(name)
            return name


def make_kb(
    num_people: int = 200, num_cities: int = 24, num_countries: int = 6, num_companies: int = 16, seed: int = 0
) -> KnowledgeBase:
    rng = random.Random(seed)
    used: set[str] = set()
    countries = [_name(rng, used, 3) + "ia" for _ in range(num_countries)]
    cities = {_name(rng, used, 3): rng.choice(countries) for _ in range(num_cities)}
    city_names = list(cities)
    companies = {_name(rng, used, 2) + " Corp": rng.choice(city_names) for _ in range(num_companies)}
    people = {
        f"{_name(rng, used, 2)} {_name(rng, used, 3)}": {
            "birth_city": rng.choice(city_names),
            "employer": rng.choice(list(companies)),
            "occupation": rng.choice(OCCUPATIONS),
        }
        for _ in range(num_people)
    }
    return KnowledgeBase(countries, cities, companies, people)


def corpus(kb: KnowledgeBase) -> Iterator[dict[str, str]]:
    """Search-R1 corpus rows: ``{"id", "contents"}`` with the title on the first line."""
    i = 0
    for person, a in kb.people.items():
        text = f"{person} is a {a['occupation']} who was born in {a['birth_city']}. {person} works for {a['employer']}."
        yield {"id": str(i), "contents": f'"{person}"\n{text}'}
        i += 1
    for city, country in kb.cities.items():
        yield {"id": str(i), "contents": f'"{city}"\n{city} is a city in {country}.'}
        i += 1
    for company, city in kb.companies.items():
        yield {"id": str(i), "contents": f'"{company}"\n{company} is a company headquartered in {city}.'}
        i += 1


def questions(kb: KnowledgeBase, seed: int = 0) -> list[tuple[str, str, GoldPlan]]:
    """``(question, data_source, plan)`` for every single- and two-hop fact, shuffled."""
    rng = random.Random(seed + 1)
    out: list[tuple[str, str, GoldPlan]] = []
    for person, a in kb.people.items():
        city, company = a["birth_city"], a["employer"]
        out.append((f"In which city was {person} born?", "synthetic_single", GoldPlan([person], city)))
        out.append((f"Which company does {person} work for?", "synthetic_single", GoldPlan([person], company)))
        out.append(
            (
                f"In which country was {person} born?",
                "synthetic_multi",
                GoldPlan(
                    [person, city],
                    kb.cities[city],
                    [
                        f"I need to find where {person} was born.",
                        f"{person} was born in {city}; which country is it in?",
                    ],
                ),
            )
        )
        out.append(
            (
                f"In which city is the employer of {person} headquartered?",
                "synthetic_multi",
                GoldPlan(
                    [person, company],
                    kb.companies[company],
                    [f"I need {person}'s employer.", f"{person} works for {company}; where is it headquartered?"],
                ),
            )
        )
    rng.shuffle(out)
    return out


def split_rows(items: list[tuple[str, str, GoldPlan]], fractions=(0.8, 0.1, 0.1)) -> dict[str, list[QARow]]:
    n = len(items)
    n_train, n_val = int(n * fractions[0]), int(n * fractions[1])
    bounds = {"train": (0, n_train), "validation": (n_train, n_train + n_val), "test": (n_train + n_val, n)}
    return {
        split: [
            make_row(q, [plan.answer], source, split, i, gold_searches=plan.searches, hops=len(plan.searches))
            for i, (q, source, plan) in enumerate(items[lo:hi])
        ]
        for split, (lo, hi) in bounds.items()
    }


def write_dataset(
    out_dir: str | Path,
    num_people: int = 200,
    seed: int = 0,
    make_model: bool = False,
    vocab_size: int = 2048,
    hidden_size: int = 64,
    tie_embeddings: bool = False,
) -> dict[str, Path]:
    """Write corpus.jsonl, kb.json, {train,validation,test}.parquet, gold.jsonl (and model/:
    a Qwen3-MoE with ``hidden_size / 16`` heads of 16 and experts of ``hidden_size``)."""
    if hidden_size <= 0 or hidden_size % 16:
        raise ValueError(f"hidden_size must be a positive multiple of 16 (heads of 16), got {hidden_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kb = make_kb(num_people=num_people, seed=seed)
    paths = {"corpus": out / "corpus.jsonl", "kb": out / "kb.json", "gold": out / "gold.jsonl"}
    rows = list(corpus(kb))
    paths["corpus"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["kb"].write_text(json.dumps(asdict(kb), indent=1))
    items = questions(kb, seed)
    for split, split_rows_ in split_rows(items).items():
        paths[split] = write_parquet(split_rows_, out / f"{split}.parquet")
    with open(paths["gold"], "w") as f:
        for q, source, plan in items:
            f.write(json.dumps({"question": q, "data_source": source, **asdict(plan), "turns": plan.turns()}) + "\n")
    if make_model:
        # the model, tokenizer and chat template need torch / transformers: only with --make-model
        import jinja2

        from ..retrieval.corpus import Passage, format_passages
        from .qa import SEARCH_INSTRUCTION
        from .tiny_model import TinyModelConfig, save_tiny_model
        from .tokenizer import CHATML_TEMPLATE, train_tokenizer

        # What the model will read: prompts as the chat template renders them, passages as
        # observations render them, and the gold turns; a tokenizer that never saw the
        # instruction spells it out byte by byte (a 269-token prompt instead of ~105).
        chat = jinja2.Template(CHATML_TEMPLATE)
        texts = (
            [
                chat.render(
                    messages=[{"role": "user", "content": SEARCH_INSTRUCTION.format(question=q)}],
                    add_generation_prompt=True,
                )
                for q, _, _ in items
            ]
            + [format_passages([Passage(r["id"], r["contents"])]) for r in rows]
            + [t for _, _, p in items for t in p.turns()]
        )
        tok = train_tokenizer(texts, vocab_size=vocab_size)
        model = TinyModelConfig(arch="qwen3_moe", hidden_size=hidden_size, num_heads=hidden_size // 16, head_dim=16,
                                intermediate_size=2 * hidden_size, tie_embeddings=tie_embeddings, seed=seed)
        paths["model"] = save_tiny_model(model, out / "model", tok)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sorl_megatron.data.synthetic", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--num-people", type=count(1, 1_000_000), default=200,
        help="people in the knowledge base (4 questions each; default 200)"
    )
    p.add_argument("--seed", type=count(0, MAX_SEED), default=0, help="random seed (default 0)")
    p.add_argument(
        "--make-model", action="store_true", help="also train a tokenizer and save a tiny random Qwen3-MoE in OUT/model"
    )
    p.add_argument("--vocab-size", type=count(256, 1 << 20), default=2048,
                   help="BPE vocabulary size with --make-model (default 2048)")
    p.add_argument("--hidden-size", type=count(16, 8192), default=64,
                   help="tiny model hidden size, a multiple of 16 (default 64)")
    p.add_argument("--tie-embeddings", action="store_true", help="tie the tiny model's input and output embeddings")
    args = p.parse_args(argv)
    paths = write_dataset(
        args.out, args.num_people, args.seed, args.make_model, args.vocab_size, args.hidden_size, args.tie_embeddings
    )
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
