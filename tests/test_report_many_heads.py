"""A report of a model with many layers and heads stays readable (SmolLM2: 30 layers x 9 heads).

Small random Llamas stand in for it (fast): the direct logit attribution shows its largest rows
open and all of them folded away, with no rows for a bias the model does not have; layer axes are
thinned past 15 layers; the generation section's attention-on-the-first-position plot is a
heatmap with a colour bar for many layers; the summary's config row shows the architecture and
no local path.

Oracles: the model's own logits (the attribution rows sum to the predicted token's logit), the
configs and biases the tests wrote, and the tick rule as stated (every 5th layer past 15).
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
import torch
import transformers as tf

import probe
from probe.report.context import ReportContext
from probe.report.html import discover, render
from probe.report.sections import residual, summary

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
WORDS = "when mary and john went to the store john gave a drink to".split()
TEXT = " ".join(WORDS[:9])


def word_tokenizer():
    """A word-level tokenizer of 60 ids (the words above, then fillers), made here: no training."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, **{w: i + 1 for i, w in enumerate(dict.fromkeys(WORDS))}}
    vocab.update({f"w{i}": i for i in range(len(vocab), 60)})
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tf.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<s>", pad_token="<s>")


TOK = word_tokenizer()
IDS = TOK(TEXT, return_tensors="pt")["input_ids"]


def tiny_llama(layers: int = 3, heads: int = 9, *, bias: bool = False, hidden: int = 72):
    """A random Llama (grouped-query attention, RMSNorm, no bias unless ``bias``)."""
    cfg = tf.LlamaConfig(
        vocab_size=60,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=3 if heads % 3 == 0 else 1,
        max_position_embeddings=32,
        attention_bias=bias,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).eval()


def _page(model, names: list[str]) -> str:
    cache = probe.capture(model, TEXT, tokenizer=TOK)
    ctx = ReportContext(caches=[cache], model=model, tokenizer=TOK)
    return render(ctx, [s for s in discover() if s.name in names])


class _Tables(HTMLParser):
    """The DLA of each position: the rows of its open table and of its folded table (name, value)."""

    def __init__(self):
        super().__init__()
        self.positions: list[dict] = []
        self._stack: list[str] = []
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class") or ""
        if tag == "details" and "probe-dla-pos" in cls:
            self.positions.append({"open": [], "all": None})
            self._stack.append("pos")
        elif tag == "details" and "probe-dla-all" in cls:
            self.positions[-1]["all"] = []
            self._stack.append("all")
        elif tag == "details":
            self._stack.append("other")
        elif tag == "tr" and self._stack and self._stack[-1] in ("pos", "all"):
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "details" and self._stack:
            self._stack.pop()
        elif tag == "td" and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            where = "open" if self._stack[-1] == "pos" else "all"
            self.positions[-1][where].append((self._row[0], float(self._row[2])))
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _dla(text: str) -> list[dict]:
    p = _Tables()
    p.feed(text)
    return p.positions


def _is_part(name: str) -> bool:
    """The embedding and whole sublayers (these sum to the logit); heads and biases split them."""
    return name == "embed" or re.fullmatch(r"L\d+\.\w+", name) is not None


def test_attribution_of_many_heads_shows_the_largest_rows_and_folds_all_of_them():
    model = tiny_llama()  # 3 layers x 9 heads, no bias: 1 + 6 + 27 = 34 rows per position
    positions = _dla(_page(model, ["residual"]))
    with torch.no_grad():
        logits = model(IDS).logits[0].double()
    assert len(positions) == IDS.shape[1]
    for t, p in enumerate(positions):
        full = p["all"]
        assert full is not None, "more rows than shown open: all of them must be in a folded table"
        names = [n for n, _ in full]
        assert len(names) == 1 + 3 * 2 + 3 * 9 and len(set(names)) == len(names)
        assert not any(n.endswith(".bias") or "bias" in n for n in names)  # the model has none
        assert len(p["open"]) == residual.TOP_K
        # the open rows are the largest |contribution| of all of them (ties at 4 decimals aside)
        cut = sorted((abs(v) for _, v in full), reverse=True)[residual.TOP_K - 1]
        assert all(abs(v) >= cut for _, v in p["open"])
        assert set(p["open"]) <= set(full)
        # the independent check: embedding + sublayers = the model's logit of its prediction
        total = sum(v for n, v in full if _is_part(n))
        assert total == pytest.approx(float(logits[t].max()), abs=1e-3)


def test_a_real_bias_keeps_its_rows_however_small():
    model = tiny_llama(bias=True)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            # HF initialises biases to zero; give them values, the second layer's tiny
            scale = 1e-6 if i == 1 else 0.5
            layer.self_attn.o_proj.bias.copy_(scale * torch.randn(layer.self_attn.o_proj.bias.shape))
    text = _page(model, ["residual"])
    for p in _dla(text):
        names = [n for n, _ in p["all"]]
        assert [n for n in names if n.endswith(".bias")] == [f"L{i}.self_attn.bias" for i in range(3)]
    assert "no bias rows" not in text


def test_a_model_without_biases_says_why_its_bias_rows_are_missing():
    text = _page(tiny_llama(layers=2, heads=3), ["residual"])  # 1 + 4 + 6 = 11 rows: all open
    positions = _dla(text)
    assert all(p["all"] is None and len(p["open"]) == 11 for p in positions)
    assert "no bias rows for 2 attention sublayers: the output projection has no bias" in text
    assert "norm bias + unembedding bias" not in text  # RMSNorm, no unembedding bias: no constant


def test_layer_axes_label_every_fifth_layer_past_fifteen():
    from matplotlib.figure import Figure

    from probe.report.matrix import layer_ticks

    for n, want in ((12, list(range(12))), (16, [0, 5, 10, 15]), (30, [0, 5, 10, 15, 20, 25])):
        ax = Figure().subplots()
        layer_ticks(ax, range(n), [2.0 * i for i in range(n)])
        assert [t.get_text() for t in ax.get_xticklabels()] == [str(i) for i in want]
        assert list(ax.get_xticks()) == [2.0 * i for i in want]
        every = {*ax.get_xticks(), *ax.get_xticks(minor=True)}  # each layer keeps a tick
        assert every == {2.0 * i for i in range(n)}


@pytest.fixture(scope="module")
def deep():
    """30 layers, like SmolLM2 (narrow, so it is fast)."""
    return tiny_llama(layers=30, heads=3, hidden=24)


def test_residual_figures_of_thirty_layers_label_every_fifth(deep):
    cache = probe.capture(deep, IDS)
    want = ["0", "5", "10", "15", "20", "25"]
    fig = probe.plot.residual_norms(cache)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == want

    class Ctx:  # the section's figure, before it becomes a PNG
        figure = staticmethod(lambda f, alt="": f)

    bars = residual._norms_figure(Ctx, probe.residual(cache))
    assert [t.get_text() for t in bars.axes[0].get_xticklabels()] == want


def test_attention_on_the_first_position_of_many_layers_is_a_heatmap(deep):
    from probe.analysis.generation import lookback
    from probe.report.sections.generation import MAX_SINK_LINES, _sink_fig

    gen = probe.generate(deep, IDS[:, :5], max_new_tokens=4)
    lb = lookback(gen.cache)
    fig = _sink_fig(lb)
    ax, bar = fig.axes  # the heatmap and its colour bar
    image = ax.get_images()[0].get_array()
    assert image.shape == (30, 4) and not ax.get_lines()
    assert bar.get_ylabel() == "attention" and ax.get_ylabel() == "layer"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "5", "10", "15", "20", "25"]
    # the cells are the mean over heads of the weight each layer put on the first position
    means = lb.sink_mass.nanmean(1)
    finite = torch.isfinite(means)
    assert torch.allclose(torch.as_tensor(image.filled(0))[finite].float(), means[finite].float(), atol=1e-6)
    few = _sink_fig(
        lookback(probe.generate(tiny_llama(layers=2, heads=3), IDS[:, :5], max_new_tokens=3).cache)
    )
    assert len(few.axes[0].get_lines()) == 2 and not few.axes[0].get_images() and MAX_SINK_LINES >= 2


def test_config_row_shows_the_architecture_and_never_a_local_path(tmp_path):
    folder = tmp_path / "my_private_models" / "llama"
    tiny_llama().save_pretrained(folder)
    model = tf.LlamaForCausalLM.from_pretrained(folder).eval()
    assert model.config.name_or_path == str(folder)
    text = _page(model, ["summary"])
    row = re.search(r'<dd class="probe-config">(.*?)</dd>', text, re.S)[1]
    main = re.match(r"\s*<code>(.*?)</code>", row, re.S)[1]
    assert main == (
        "model_type=llama, num_hidden_layers=3, num_attention_heads=9, num_key_value_heads=3, "
        "hidden_size=72, vocab_size=60"
    )
    assert "<details" in row and "intermediate_size=144" in row  # the rest, folded away
    assert "my_private_models" not in row and "_name_or_path" not in row.split("</summary>")[1]
    assert "_name_or_path left out: a local path" in row


def test_local_paths_are_recognised_and_hub_ids_are_not():
    rows = summary.config_rows(
        {
            "model_type": "x",
            "_name_or_path": "checkpoints/run1/model",  # relative, not a hub id
            "tokenizer": "~/tok",
            "base": "org/name",
            "sub": {"_name_or_path": "C:\\models\\x", "url": "https://example.org/a/b"},
        }
    )
    assert rows["hidden"] == ["_name_or_path", "tokenizer"]
    assert rows["main"] == [
        ("model_type", "x"),
        ("base", "org/name"),
        ("sub", {"_name_or_path": "<local path>", "url": "https://example.org/a/b"}),
    ]
