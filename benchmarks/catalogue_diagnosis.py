"""The cause, in one line, of each catalogue verdict other than exact that has been looked into
(shown in the "cause" column of ``docs/catalogue.md``; keyed by model type). Written by hand
from reading the model's code and the sweep's counts; update it when a fix lands."""

from __future__ import annotations

SINK = (
    "attention sinks: the softmax runs over the keys plus a learned sink column (last axis T+1) "
    "and the sink is dropped after it, so probe sees no softmax over the keys (issue 22, sinks)"
)
LOOP = "one layer module runs several times per forward; probe keeps one layer per module (issue 22, item 2)"
PER_LAYER = (
    "probe reads a per-layer attribute from the global config (`capture/naming.py:33`); transformers "
    "5.24 per-layer configs raise AmbiguousGlobalPerLayerAttributeError there"
)

UNMAPPED = "a softmax over a layout probe does not map: refused with a clear error naming the layers"
TWO = "two self-attention softmaxes in one layer: refused (issue 22, several patterns per layer)"

CHANNELS = (
    "a false refusal, named: the channel check of `probe/capture/audio.py` (issue 32, in progress) takes "
    "the conformer's depthwise `Conv1d` inside a layer (as wide as the hidden size) for a front end the "
    "mel bins must fit; on the same inputs the capture was exact against eager and SDPA before that check"
)

CAUSES: dict[str, str] = {
    "mobilevit": "refused, named: each MobileViT stage runs a small transformer (2 to 4 layers) inside "
    "one `encoder.layer[i]`, which probe takes for one layer; its inner layers' attentions, once "
    "stored side by side as heads, are now attentions of their own, and one layer holding several "
    "in one sublayer is refused (mapping a stage's inner layers to layers of their own is not built)",
    "shieldgemma2": "refused, named: with an image, the language model's two layers are not recognised "
    "as layers (the whole `model` is taken for one); their attentions, once stored as one layer of "
    "8 heads, are now attentions of their own and the layer is refused. Exact on text alone",
    "albert": LOOP + " (ALBERT's shared layer group)",
    "hrm_text": LOOP + " (HRM's L-module layer, 6 calls)",
    "gpt_oss": SINK,
    "flint": SINK,
    "openai_privacy_filter": SINK,
    "hy_v4": SINK,
    "inkling2_text": UNMAPPED,
    "inkling2_loop_text": UNMAPPED,
    "mimo_v2_flash": "attention sinks on its sliding-window layers only: probe stores the full layer and "
    "drops the sink layer without a word (1 pattern, eager 2) (issue 22, sinks)",
    "deepseek_v4": "a sink column and two attentions per layer: refused as two self-attention patterns in "
    "one layer (issue 22, several patterns per layer)",
    "diffllama": "not wrong: probe stores the model's 4 differential heads a₁ − λ·a₂ and the two softmaxes "
    "as `parts` (tests/test_attention_kinds.py); this checker compares eager's 8 softmaxes head for head",
    "longformer": "not wrong: the sliding-chunk weights are mapped back to [query, key] "
    "(tests/test_local_attention.py, exact against eager mapped back); this checker does not map eager's "
    "[query, window] layout back",
    "led": "not wrong: the encoder's sliding-chunk attention is mapped back to [query, key] "
    "(tests/test_local_attention.py); this checker does not map eager's [query, window] layout back",
    "longt5": "not wrong: the encoder's block-local attention is mapped back to [query, key] "
    "(tests/test_local_attention.py); eager returns 5-d blocks, which this checker does not map back",
    "reformer": "local and LSH attention over chunks/buckets: no softmax over keys "
    "(issue 22, local attention)",
    "t5gemma2": "the decoder runs self and cross attention in one SDPA call over [self keys; encoder keys]; "
    "probe stores 4 patterns where eager returns 6 (self and cross apart) (issue 22, roles)",
    "funnel": "patterns do not line up with eager's (pattern 1: 8×8 stored where eager has the pooled "
    "4×8); the issue saw encoder self-attention stored as decoder cross-attention (issue 22, stacks)",
    "cpmant": "CpmAnt prepends 32 prompt positions and crops its returned attentions to the text "
    "(8×8); probe stores the full 40×40 softmax the layers compute (its last 8×8 block equals eager's, "
    "tests/test_attention_kinds.py); the metadata does not yet mark the prefix",
    "prophetnet": "n-gram (predict-stream) attention over a layout probe does not map: refused with a "
    "clear error naming the layers (it was stored as 6 patterns before)",
    "squeezebert": "refused: probe takes the whole `encoder` as one layer although it holds `encoder.layers` "
    "(a ModuleList of SqueezeBertModule), so two layers' attentions look like two patterns of one layer",
    "longcat_flash": "two attention sublayers per layer: refused as two self-attention patterns in one "
    "layer (issue 22, several patterns per layer)",
    "glm5_next": TWO,
    "glm5_next_text": TWO,
    "dots3_note_text": PER_LAYER,
    "gemma4_text": PER_LAYER,
    "gemma4_unified_text": PER_LAYER,
    "embedding_gemma2_text": PER_LAYER,
    "neomme": PER_LAYER,
    "inkling2": UNMAPPED,
    "inkling2_loop": UNMAPPED,
    "esmfold2": "a protein-folding model: its atom encoder's 3D rotary needs more frequency pairs than "
    "the shrunk head holds, and the atom encoder has no model type to override by",
    "gemma4_assistant": "a draft model that reads every layer's keys and values from the main model's "
    "cache (num_kv_shared_layers = all layers); its default config fails its own validator "
    "(hidden_size_per_layer_input must be 0) and it does not run alone",
    "gemma4_unified_assistant": "a draft model that reads every layer's keys and values from the main "
    "model's cache (num_kv_shared_layers = all layers): its text config fails the cache-producer check "
    "when built alone",
    "llama4": "transformers' Llama4ForConditionalGeneration fails on text alone (it reads `image_outputs` "
    "from the language model's output, which has none); its text model is the row `llama4_text`",
    "layoutxlm": "LayoutXLM's checkpoints run as LayoutLMv2Model, which needs detectron2 (see layoutlmv2)",
    "speecht5_hifigan": "the HiFi-GAN vocoder of SpeechT5 (SpeechT5HifiGan, no auto mapping): a waveform "
    "generator with no attention",
    "qwen3_omni_moe_talker_text": "the text model of the Qwen3-Omni talker, built inside "
    "`qwen3_omni_moe_talker` (which holds it under a plain attribute)",
    "dia": "the decoder takes audio codebook ids ([batch, T, channels]), not token ids",
    "kyutai_speech_to_text": "the ids are audio codebook ids offset per codebook, not text token ids",
    **dict.fromkeys(
        (
            "canary",
            "cohere_asr",
            "fun_asr_nano",
            "fun_asr_nano_encoder",
            "lasr_ctc",
            "lasr_encoder",
            "nemotron3_5_asr",
            "nemotron3_diarization",
            "nemotron_asr_streaming",
            "nemotron_asr_streaming_encoder",
            "parakeet_ctc",
            "parakeet_encoder",
            "parakeet_rnnt",
            "parakeet_tdt",
            "wav2vec2-bert",
        ),
        CHANNELS,
    ),
    "gemma4_audio": "its conformer's chunked local attention is a layout probe does not map (refused, named, "
    "before the channel check of `probe/capture/audio.py` refused it earlier, falsely)",
    "gemma3n_audio": "its conformer's chunked local attention is a layout probe does not map: refused, named",
    "clap_audio_model": "HTSAT, a Swin over the spectrogram: the windows do not fit the grid probe reads off "
    "the model (it reads it from pictures): refused, named",
    "clap": "its audio tower is HTSAT (see clap_audio_model): refused, named",
    "sew-d": "SEW-D's XSoftmax zeroes the masked keys in place after its softmax: refused, named",
    "neucodec": "its forward takes a waveform and the features of a semantic model of it together; not made",
    "xcodec2": "its forward takes a waveform and the features of a semantic model of it together; not made",
    "granite_speech5_ctc": "the tiny config's block attention fails in transformers' own forward (heads "
    "folded into the batch per block do not line up with its position bias)",
    "granite_speech5_encoder": "the tiny config's block attention fails in transformers' own forward (heads "
    "folded into the batch per block do not line up with its position bias)",
    "minimax": "exact on its softmax layer; the lightning (linear) attention layer has no softmax "
    "(eager returns q·kᵀ with decay, negative weights) and is not stored, with no note",
}
