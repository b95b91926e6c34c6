"""Grammar-mask timings: full-vocabulary ``allowed_mask`` at JSON grammar states.

    python bench/bench_grammar.py [-m model.gguf] [-r 5]

Prints the one-time vocabulary index build, then for each state (a JSON prefix
accepted into a JSON-schema grammar) the first mask (which also fills the lazily
built state machine) and the mean of ``-r`` repeats, with how many tokens are allowed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from opencoti.engine.grammar import Grammar, GrammarMatcher, vocab_index  # noqa: E402
from opencoti.engine.json_schema import json_object_grammar, schema_to_grammar  # noqa: E402
from opencoti.model.loader import load_model  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}, "tags": {"type": "array",
                                                                                "items": {"type": "string"}}},
          "required": ["name", "age"]}

CASES = [
    ("json_object", ""),
    ("json_object", "{"),
    ("json_object", '{"key'),
    ("json_object", '{"key": "some text'),
    ("json_object", '{"key": 12'),
    ("json_object", '{"key": [1, {"a": null}, '),
    ("json_object", '{"key": true}'),
    ("person", '{"name": "Ada L'),
    ("person", '{"name": "Ada", "age": 3'),
    ("person", '{"name": "Ada", "age": 36, "tags": ["x", "y'),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-r", "--repeats", type=int, default=5)
    a = ap.parse_args()
    tok = load_model(a.model).tokenizer
    t = time.perf_counter()
    vi = vocab_index(tok)
    print(f"vocab index: {vi.n_vocab} tokens, {vi.n_nodes} trie nodes, built in "
          f"{(time.perf_counter() - t) * 1e3:.0f} ms\n")
    grammars = {"json_object": Grammar.parse(json_object_grammar()), "person": Grammar.parse(schema_to_grammar(PERSON))}
    print(f"| {'grammar':<11} | {'state (text so far)':<44} | first ms | mean ms | allowed |")
    print(f"|{'-' * 13}|{'-' * 46}|---------:|--------:|--------:|")
    for name, prefix in CASES:
        m = GrammarMatcher(grammars[name], tok)
        m.accept_string(prefix)
        t = time.perf_counter()
        mask = m.allowed_mask()
        first = (time.perf_counter() - t) * 1e3
        times = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            m.allowed_mask()
            times.append((time.perf_counter() - t) * 1e3)
        print(f"| {name:<11} | {prefix!r:<44} | {first:8.1f} | {statistics.mean(times):7.1f} | {int(mask.sum()):7d} |")


if __name__ == "__main__":
    main()
