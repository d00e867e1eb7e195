"""Writes the lm-eval tasks' data (benchmarks/data/lm_eval_*.jsonl), deterministically, from the tables below: world
capitals and antonyms as 4-way multiple choice (loglikelihood) and two-number arithmetic (generate_until).

    python benchmarks/lm_eval_tasks/make_data.py [--out benchmarks/data]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "the United Kingdom": "London", "Ireland": "Dublin", "Belgium": "Brussels", "the Netherlands": "Amsterdam",
    "Austria": "Vienna", "Switzerland": "Bern", "Poland": "Warsaw", "Czechia": "Prague", "Hungary": "Budapest",
    "Greece": "Athens", "Sweden": "Stockholm", "Norway": "Oslo", "Denmark": "Copenhagen", "Finland": "Helsinki",
    "Iceland": "Reykjavik", "Russia": "Moscow", "Ukraine": "Kyiv", "Romania": "Bucharest", "Bulgaria": "Sofia",
    "Serbia": "Belgrade", "Croatia": "Zagreb", "Turkey": "Ankara", "Egypt": "Cairo", "Morocco": "Rabat",
    "Kenya": "Nairobi", "Nigeria": "Abuja", "Ethiopia": "Addis Ababa", "Ghana": "Accra", "Senegal": "Dakar",
    "South Africa": "Pretoria", "Japan": "Tokyo", "China": "Beijing", "South Korea": "Seoul", "India": "New Delhi",
    "Pakistan": "Islamabad", "Bangladesh": "Dhaka", "Thailand": "Bangkok", "Vietnam": "Hanoi",
    "Indonesia": "Jakarta", "the Philippines": "Manila", "Malaysia": "Kuala Lumpur", "Iran": "Tehran",
    "Iraq": "Baghdad", "Saudi Arabia": "Riyadh", "Israel": "Jerusalem", "Afghanistan": "Kabul", "Nepal": "Kathmandu",
    "Australia": "Canberra", "New Zealand": "Wellington", "Canada": "Ottawa", "the United States": "Washington",
    "Mexico": "Mexico City", "Cuba": "Havana", "Brazil": "Brasilia", "Argentina": "Buenos Aires", "Chile": "Santiago",
    "Peru": "Lima", "Colombia": "Bogota", "Venezuela": "Caracas", "Ecuador": "Quito", "Uruguay": "Montevideo",
    "Bolivia": "La Paz", "Paraguay": "Asuncion", "Jamaica": "Kingston", "Lebanon": "Beirut", "Syria": "Damascus",
    "Jordan": "Amman", "Qatar": "Doha", "Mongolia": "Ulaanbaatar", "Cambodia": "Phnom Penh", "Sri Lanka": "Colombo",
    "Lithuania": "Vilnius", "Latvia": "Riga", "Estonia": "Tallinn", "Slovakia": "Bratislava", "Slovenia": "Ljubljana",
    "Albania": "Tirana", "Tunisia": "Tunis", "Algeria": "Algiers", "Libya": "Tripoli", "Sudan": "Khartoum",
    "Uganda": "Kampala", "Tanzania": "Dodoma", "Zimbabwe": "Harare", "Zambia": "Lusaka", "Angola": "Luanda",
}

ANTONYMS = {
    "hot": "cold", "big": "small", "fast": "slow", "happy": "sad", "light": "dark", "up": "down", "open": "closed",
    "early": "late", "rich": "poor", "strong": "weak", "hard": "soft", "full": "empty", "young": "old",
    "tall": "short", "wet": "dry", "clean": "dirty", "loud": "quiet", "thick": "thin", "heavy": "light",
    "high": "low", "inside": "outside", "win": "lose", "buy": "sell", "push": "pull", "begin": "end",
    "true": "false", "love": "hate", "alive": "dead", "friend": "enemy", "day": "night", "north": "south",
    "east": "west", "left": "right", "first": "last", "good": "bad", "easy": "difficult", "cheap": "expensive",
    "safe": "dangerous", "wide": "narrow", "deep": "shallow", "sharp": "dull", "smooth": "rough", "sweet": "sour",
    "brave": "cowardly", "kind": "cruel", "polite": "rude", "arrive": "leave", "remember": "forget",
    "accept": "refuse", "increase": "decrease", "above": "below", "before": "after", "always": "never",
    "question": "answer", "laugh": "cry", "start": "finish", "give": "take", "near": "far", "come": "go",
    "male": "female", "winter": "summer", "sunrise": "sunset", "entrance": "exit", "victory": "defeat",
    "success": "failure", "ancient": "modern", "asleep": "awake", "guilty": "innocent", "public": "private",
}


def multiple_choice(table: dict[str, str], key: str, rng: random.Random) -> list[dict]:
    answers = sorted(set(table.values()))
    docs = []
    for item, answer in table.items():
        choices = rng.sample([a for a in answers if a != answer], 3) + [answer]
        rng.shuffle(choices)
        docs.append({key: item, "choices": choices, "answer": choices.index(answer)})
    return docs


def arithmetic(count: int, rng: random.Random) -> list[dict]:
    docs = []
    for _ in range(count):
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        op = rng.choice("+-")
        docs.append({"a": a, "b": b, "op": op, "answer": str(a + b if op == "+" else a - b)})
    return docs


def write(out: Path, name: str, docs: list[dict]) -> None:
    with open(out / name, "w") as handle:
        handle.writelines(json.dumps(doc) + "\n" for doc in docs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DATA)
    out = parser.parse_args(argv).out
    rng = random.Random(16)
    write(out, "lm_eval_capitals.jsonl", multiple_choice(CAPITALS, "country", rng))
    write(out, "lm_eval_antonyms.jsonl", multiple_choice(ANTONYMS, "word", rng))
    write(out, "lm_eval_arithmetic.jsonl", arithmetic(150, rng))


if __name__ == "__main__":
    main()
