"""``train.eod_first``: every training and validation sample starts with the EOD token, the
sample moved one token right behind it, on the CPU: the setting and its checks, the dataset
wrapper on random samples, and the real Megatron datasets built with it against the same
datasets without it (the evaluator's side: tests/training/test_long_context_eval.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_s2.training.data import EodFirst, build_datasets  # noqa: E402
from megatron_s2.training.run_config import (  # noqa: E402
    DEMO_CONFIG,
    ConfigError,
    load_config,
    resume_changes,
)
from megatron_s2.training.tokenizer import load_tokenizer  # noqa: E402


def _cfg(*overrides: str):
    return load_config(DEMO_CONFIG, list(overrides))


def test_setting_and_its_checks():
    assert _cfg().train.eod_first is False
    assert _cfg("train.eod_first=true").train.eod_first is True
    for refused in (
        ("train.eod_first=true", "train.reset_position_ids=true"),
        ("train.eod_first=true", "train.reset_position_ids=true", "train.pack_documents=true"),
    ):
        with pytest.raises(ConfigError) as err:
            _cfg(*refused)
        text = str(err.value)
        assert "train.eod_first=true cannot go with train.reset_position_ids=true" in text
        assert "set train.eod_first=false" in text
    with pytest.raises(ConfigError, match="train.eod_first must be of type bool"):
        _cfg("train.eod_first=first")
    # What the weights were trained to read: refused on a resume of the run's own checkpoint,
    # noted (printed) where a run or an evaluation starts from another run's weights.
    saved, eod = _cfg().to_dict(), _cfg("train.eod_first=true")
    assert [c.key for c in resume_changes(saved, eod, own=True).refused] == ["train.eod_first"]
    other = resume_changes(saved, eod, own=False)
    assert [c.key for c in other.noted] == ["train.eod_first"] and not other.refused
    # A checkpoint saved before the setting existed trained without it.
    del saved["train"]["eod_first"]
    assert [c.key for c in resume_changes(saved, eod, own=True).refused] == ["train.eod_first"]
    assert not resume_changes(saved, _cfg(), own=True).refused


class _Samples(torch.utils.data.Dataset):
    """Random GPT samples as Megatron's dataset returns them."""

    def __init__(self, n: int, seq: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.items = [
            {
                "tokens": torch.randint(0, 50, (seq,), generator=g),
                "labels": torch.randint(0, 50, (seq,), generator=g),
                "loss_mask": torch.rand(seq, generator=g),
                "position_ids": torch.arange(seq),
            }
            for _ in range(n)
        ]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _moved(before: dict, eod: int, first_mask: float) -> dict:
    """The sample one token right behind ``eod``, written out position by position."""
    s = before["tokens"].numel()
    tokens = [eod] + [int(before["tokens"][i - 1]) for i in range(1, s)]
    labels = [int(before["tokens"][0])] + [int(before["labels"][i - 1]) for i in range(1, s)]
    mask = [first_mask] + [float(before["loss_mask"][i - 1]) for i in range(1, s)]
    return {"tokens": tokens, "labels": labels, "loss_mask": mask}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wrapper_moves_the_sample_behind_eod(seed):
    source = _Samples(5, 17 + seed, seed)
    wrapped = EodFirst(source, eod=99)
    assert len(wrapped) == 5
    for i in range(5):
        before = {k: v.clone() for k, v in source[i].items()}
        got = wrapped[i]
        want = _moved(before, 99, 1.0)
        assert got["tokens"].tolist() == want["tokens"]
        assert got["labels"].tolist() == want["labels"]
        assert got["loss_mask"].tolist() == pytest.approx(want["loss_mask"])
        assert got["tokens"].dtype == before["tokens"].dtype
        assert got["loss_mask"].dtype == before["loss_mask"].dtype
        assert torch.equal(got["position_ids"], before["position_ids"])
        for k, v in source[i].items():  # the wrapped dataset's own samples are untouched
            assert torch.equal(v, before[k]), k


def test_an_eod_label_at_position_0_follows_eod_mask_loss():
    source = _Samples(1, 8, 0)
    source.items[0]["tokens"][0] = 7  # the sample starts with an EOD (id 7 here)
    for masked, first in ((True, 0.0), (False, 1.0)):
        got = EodFirst(source, eod=7, eod_mask_loss=masked)[0]
        assert int(got["labels"][0]) == 7 and float(got["loss_mask"][0]) == first


def test_megatron_datasets_with_and_without_eod_first(tmp_path):
    from megatron_s2.training.demo_corpus import ensure_demo_data

    prefix = ensure_demo_data(str(tmp_path / "docs"), num_docs=200)
    tok = load_tokenizer("byte")

    def build(eod_first: bool):
        return build_datasets(
            [prefix], None, tokenizer=tok, seq_length=64, seed=3, split="90,10,0",
            train_samples=12, valid_samples=4, cache_dir=str(tmp_path / "cache"),
            eod_first=eod_first,
        )  # fmt: skip

    plain, first = build(False), build(True)
    assert first.eod == plain.eod == tok.eod
    for split in ("train", "valid"):
        a, b = getattr(plain, split), getattr(first, split)
        assert len(a) == len(b) > 0
        starts = set()
        for i in range(len(a)):
            x, y = a[i], b[i]
            starts.add(int(x["tokens"][0]))
            want = _moved(x, tok.eod, 1.0)
            assert y["tokens"].tolist() == want["tokens"]
            assert y["labels"].tolist() == want["labels"]
            assert y["loss_mask"].tolist() == pytest.approx(want["loss_mask"])
        assert starts != {tok.eod}, split  # without it samples start anywhere in a document
