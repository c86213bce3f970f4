"""megatron_s2.hf.convert.prepend_eod: the exported tokenizer of a ``train.eod_first`` model puts
the EOD token in front of every text transformers encodes (with special tokens), and gives the
trainer's own ids without them, for the tokenizer kinds a run uses: one without a
post-processor, a byte-level BPE one (GPT-2's: its post-processor only trims offsets) and one
whose post-processor adds a BOS the trainer never saw (Llama's)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from megatron_s2.hf.convert import prepend_eod
from megatron_s2.training.tokenizer import HFTokenizer

pytestmark = pytest.mark.version_independent

TEXTS = ["def f(x):\n    return x + 1\n", "alpha beta  gamma", "x", ""]


def _word_level() -> Tokenizer:
    words = {"</s>": 0, "<unk>": 1} | {
        w: i + 2 for i, w in enumerate("def f x return + 1 alpha beta gamma".split())
    }
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def _byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS * 20, trainer)
    return tok


def _with_bos_template() -> Tokenizer:
    tok = _byte_level_bpe()
    tok.add_special_tokens(["<s>"])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", bos)]
    )
    return tok


@pytest.mark.parametrize(
    "build, eod_token, config",
    [
        (_word_level, "</s>", {"eos_token": "</s>"}),
        (_byte_level_bpe, "<|endoftext|>", None),
        (_with_bos_template, "<|endoftext|>", {"eos_token": "<|endoftext|>", "bos_token": "<s>"}),
    ],
)
def test_transformers_puts_eod_first_and_the_trainer_reads_the_same_ids(
    tmp_path, build, eod_token, config
):
    tok = build()
    tok.save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        if "bos_token" in config:  # the older file that names special tokens too
            (tmp_path / "special_tokens_map.json").write_text(json.dumps(config))
    trainer_before = HFTokenizer(tmp_path, eod_token=eod_token)
    eod = trainer_before.eod
    before = [trainer_before.encode(t) for t in TEXTS]
    prepend_eod(tmp_path, eod_token, eod)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    after = HFTokenizer(tmp_path, eod_token=eod_token)
    assert (after.eod, after.vocab_size) == (eod, trainer_before.vocab_size)
    for text, ids in zip(TEXTS, before):
        assert after.encode(text) == ids  # the trainer's encoding is unchanged
        assert hf(text).input_ids == [eod, *ids], text
        assert hf(text, add_special_tokens=False).input_ids == ids
        assert hf.decode(hf(text).input_ids, skip_special_tokens=True) == hf.decode(ids)
    assert hf.bos_token_id == eod
    saved = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert saved["bos_token"] == eod_token and saved["add_bos_token"] is True
    if config and "eos_token" in config:
        assert saved["eos_token"] == config["eos_token"]  # the rest of the config is kept
    if config and "bos_token" in config:
        special = json.loads((tmp_path / "special_tokens_map.json").read_text())
        assert special == {**config, "bos_token": eod_token}
    else:
        assert not (tmp_path / "special_tokens_map.json").exists()

    # A model imported from an export and exported again: the same tokenizer, byte-level
    # offsets included (the first export's Sequence keeps its byte-level step).
    once = (tmp_path / "tokenizer.json").read_text()
    offsets = [hf(text, return_offsets_mapping=True)["offset_mapping"] for text in TEXTS]
    prepend_eod(tmp_path, eod_token, eod)
    assert (tmp_path / "tokenizer.json").read_text() == once
    again = AutoTokenizer.from_pretrained(tmp_path)
    for text, ids, spans in zip(TEXTS, before, offsets):
        assert again(text).input_ids == [eod, *ids]
        assert again(text, return_offsets_mapping=True)["offset_mapping"] == spans
