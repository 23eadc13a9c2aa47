"""shardwise reads every torch.save archive as torch 2.15 and torch 2.3.1 read it (issue 44): the
differential fuzzer's corpus (``fuzz/corpus/torch_reader``, kept by hour-long runs of
``torch_reader_diff.py run``) is replayed, and a fresh seeded batch of archives is generated and
compared. The rule compared and what a FAIL is: torch_reader_diff.py."""

from __future__ import annotations

import random
from pathlib import Path

import torch_reader_diff as diff

CORPUS = diff.ROOT / "fuzz" / "corpus" / "torch_reader"


def test_both_torch_oracles_run():
    assert diff.TORCH231.exists(), "the torch 2.3.1 side venv (make setup-test) is missing"
    assert len(diff.oracles()) == 2


def test_the_corpus_reads_as_torch_reads_it():
    files = list(CORPUS.glob("*.bin"))
    assert len(files) >= 50, "the committed corpus is missing"
    assert diff.replay(CORPUS) == []


def test_a_fresh_batch_reads_as_torch_reads_it(tmp_path: Path):
    diff.generate_into(tmp_path, random.Random(20261207), 300)
    results = diff.check_dir(tmp_path, diff.shardwise_binary())
    fails = [(f, v) for f, v, _ in results if any(x == "FAIL" for x, _ in v)]
    assert fails == []
    # The batch exercises both sides: archives both read alike, and archives shardwise refuses.
    accepted = sum("error" not in view for _, _, view in results)
    assert 0.3 * len(results) < accepted < 0.95 * len(results), accepted
