"""Per-family overrides of the catalogue's generic shrink (``tests/catalogue_configs.py``): config
keyword arguments applied last, by model type (also to a sub-config of that model type inside a
parent), and the model class where the auto mapping's base class does not take the config."""

from __future__ import annotations

from typing import Any

# the sizes of the generic shrink (catalogue_configs imports them from here)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 64, 4, 2, 16, 128, 512, 2

# per-family overrides, applied last (keys: model_type; values: config keyword arguments)
OVERRIDES: dict[str, dict[str, Any]] = {
    "albert": {"embedding_size": 32, "num_hidden_groups": 1},
    "bigbird_pegasus": {"attention_type": "original_full"},
    "big_bird": {"attention_type": "original_full"},
    "funnel": {"block_sizes": [1, 1], "block_repeats": [1, 1], "num_decoder_layers": 1},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2, "window_size": 4},
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    "longformer": {"attention_window": [4, 4]},
    "led": {"attention_window": [4, 4]},
    "reformer": {
        "attn_layers": ["local", "lsh"],
        "axial_pos_shape": [4, 8],
        "axial_pos_embds_dim": [32, 32],
        "local_attn_chunk_length": 4,
        "lsh_attn_chunk_length": 4,
        "num_buckets": 2,
        # LSH buckets come from random rotations, drawn anew each forward unless seeded: the
        # check compares two forwards (probe's and eager's), so they must hash alike
        "hash_seed": 0,
    },
    "canine": {"downsampling_rate": 2, "num_hash_buckets": 64, "num_hash_functions": 2},
    "gptj": {"rotary_dim": 8},
    "codegen": {"rotary_dim": 8},
    "xlnet": {"n_head": HEADS, "d_head": HEAD_DIM},
    "openai-gpt": {"n_positions": 64},
    "ctrl": {"n_positions": 64},
    "mega": {"chunk_size": 4},
    # as many landmarks as tokens (8): the exact-softmax path (fewer mis-shape the padding mask)
    "nystromformer": {"segment_means_seq_len": 8, "num_landmarks": 8},
    # layout embeddings: 4 coordinate + 2 shape embeddings concatenated to the hidden size
    "layoutlmv3": {"coordinate_size": 10, "shape_size": 12},
    "lilt": {"hidden_size": 96},  # its box embeddings are hidden/6 wide, times 6
    "qwen2_5_omni_thinker": {"vision_start_token_id": 500},
    "xlstm": {"embedding_dim": HIDDEN},
    # input, recurrent (run n_recurrent_loops times) and output layers: one of each
    "dory": {
        "num_hidden_layers": 3,
        "n_input_layers": 1,
        "n_recurrent_layers": 1,
        "n_output_layers": 1,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    # Apertus 1.5: image then audio codebook tokens at the top of the text vocabulary (512)
    "apertus1p5": {"image_token_offset": 200, "audio_token_offset": 264},
    "apertus1p5_vision_tokenizer": {"codebook_size": 64},
    "wavtokenizer_encoder": {"codebook_size": 128},
    "qwen2_5_omni_talker": {"embedding_size": HIDDEN},  # its embeddings feed the layers directly
    "molmo2_adapter": {"vision_feature_layer": [-1, -2]},  # the last two of the shrunk vision tower
    # MusicGen: one codebook (decoder ids [batch, T]); the vocabulary where the check looks for it
    "musicgen": {"vocab_size": VOCAB},
    "musicgen_melody": {"vocab_size": VOCAB},
    "musicgen_decoder": {"num_codebooks": 1},
    "musicgen_melody_decoder": {"num_codebooks": 1},
    # towers whose adapters feed the text model: out at the text width
    "dots3_note_vision_encoder": {"adapter_out_dim": HIDDEN},
    "dots3_note_audio_encoder": {"adapter_out_dim": HIDDEN},
    # sub-model configs whose defaults lack an attribute their model reads
    "t5gemma2_text": {"dropout_rate": 0.0},
    "pix2struct_text_model": {"initializer_range": 0.1},
    "qwen3_omni_moe_thinker": {"vision_start_token_id": 500},
    "clvp": {},
    "blt": {"patch_size": 2},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "nemotron": {"head_dim": HEAD_DIM},
    "squeezebert": {"embedding_size": HIDDEN},
    "step3p5": {"sliding_window": 4},
    "step3p7": {"sliding_window": 4},
    "esm": {"pad_token_id": 1, "mask_token_id": 2},
    "chameleon": {"vocabulary_map": {"<image>": 3}},
    "emu3": {"vocabulary_map": {"<image>": 3}},
    # defaults of None that the modeling code multiplies or indexes with
    "deepseek_v2": {"num_experts_per_tok": 2},
    # the rotary parameters default to {} where the model reads them per layer type
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}},
    },
    "diffusion_gemma_text": {"num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
    "mistral4": {"head_dim": 16},  # the rotary part is head_dim · partial_rotary_factor (0.5) wide
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse"], "num_experts_per_tok": 2},
    # the shared transformer is tied across hybrid layers: two of them (layers 1 and 3)
    "zamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "layers_block_type": ["linear_attention", "hybrid"] * 2,
    },
    "kimi_linear": {"num_experts_per_token": 2},  # its own name for num_experts_per_tok
    "glm4_moe_lite": {"num_key_value_heads": HEADS},  # MLA: one latent kv per head
    "dots1": {
        "n_routed_experts": 4,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
    },
    # the indexer (query-sparse attention) sizes default to None, which its layers divide by
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 4,  # fewer than the 8 tokens: the indexer really selects keys
        "indexer_compress_ratio": 2,
    },
    # KV sharing: the last layers reuse the caches of earlier ones of the same type (4 layers, 2 shared)
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
        "activation_sparsity_pattern": [0.0] * 4,
        "intermediate_size": FFN,
    },
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # validators: ESM C has no grouped-query attention; Mamba-2 ties heads·head_dim to hidden·expand
    "esmc": {"num_key_value_heads": HEADS},
    "mamba2": {"num_heads": 8},
    # image and vision-language families (inputs from tests/catalogue_inputs.py): a dict for a
    # sub-config is laid over its shrunk dict. Image tokens need an id in the text vocabulary.
    "blip-2": {"image_token_index": 500},
    "instructblip": {"image_token_index": 500},
    # the joint space is the EfficientNet tower's pooled width, which it does not project
    "align": {"projection_dim": 640},
    # patch grids the pixel shuffle / pooling divides: 14 × 14 patches pooled 2 × 2 (7 × 7 tokens)
    "gemma3": {"mm_tokens_per_image": 49},
    "shieldgemma2": {
        "mm_tokens_per_image": 49,
        "image_token_index": 509,
        "boi_token_index": 510,
        "eoi_token_index": 511,
        "yes_token_index": 507,
        "no_token_index": 508,
    },
    # VipLLaVA reads five layers of a 24-layer tower: two of the shrunk one, in the same count
    "vipllava": {"vision_feature_layers": [-2, -1, -2, -1, 0]},
    "idefics3": {"vision_config": {"patch_size": 16}},
    "smolvlm": {"vision_config": {"patch_size": 16}},
    "aya_vision": {"vision_config": {"image_size": 364}},  # 26 × 26 patches, downsampled 2 × 2
    "aria": {"vision_config": {"image_size": 490, "patch_size": 14}},  # 35 × 35: its 1225-patch query set
    # Pixtral's image_size is the largest it takes (1540 px: 12,100 patches); it runs any size below
    "pixtral": {"image_size": 224},
    # ViLT samples image patches at random per forward unless it keeps them all
    "vilt": {"max_image_length": -1},
    # windowed towers: stages of widths 32 and 64, heads dividing them (the generic shrink leaves the
    # per-stage lists alone)
    "swin": {"embed_dim": 32, "depths": [2, 2], "num_heads": [2, 4]},
    "swinv2": {"embed_dim": 32, "depths": [2, 2], "num_heads": [2, 4]},
    "donut-swin": {"embed_dim": 32, "depths": [2, 2], "num_heads": [2, 4]},
    "maskformer-swin": {"embed_dim": 32, "depths": [2, 2], "num_heads": [2, 4]},
    # audio families (inputs from tests/catalogue_audio.py): encoders whose positions fix the input
    # length (2 · max_source_positions mel frames) take 64 frames, not 3000
    "whisper": {"max_source_positions": 32},
    "qwen2_audio_encoder": {"max_source_positions": 32},
    "voxtral_encoder": {"max_source_positions": 32},
    "moss_transcribe_diarize_audio": {"max_source_positions": 32},
    "audioflamingo3_encoder": {"max_source_positions": 32},
    "audio-spectrogram-transformer": {"max_length": 64, "num_mel_bins": 32},
    # Seamless M4T's speech encoder and unit model keep their own (full) sizes under their own names
    "seamless_m4t": {
        "speech_encoder_layers": LAYERS,
        "speech_encoder_attention_heads": HEADS,
        "speech_encoder_intermediate_size": FFN,
        "t2u_encoder_layers": LAYERS,
        "t2u_decoder_layers": LAYERS,
        "t2u_encoder_attention_heads": HEADS,
        "t2u_decoder_attention_heads": HEADS,
        "t2u_encoder_ffn_dim": FFN,
        "t2u_decoder_ffn_dim": FFN,
    },
    # VibeVoice's tokenizers: 26 convolution blocks over the waveform, one per stage is enough
    "vibevoice_acoustic_tokenizer": {"depths": [1] * 7},
    "vibevoice_acoustic_tokenizer_encoder": {"depths": [1] * 7},
    # CLAP's audio tower (HTSAT, a Swin over the spectrogram) ends at patch width · 2^(stages - 1)
    "clap_audio_model": {"hidden_size": 192},
    # Granite Speech's Q-Former projector reads the speech encoder's output (its hidden_dim)
    "granite_speech": {"projector_config": {"encoder_hidden_size": FFN}},
    "granite_speech_plus": {"projector_config": {"encoder_hidden_size": FFN}},
    "voxtral": {"audio_token_id": 500},  # None by default: no audio position in the text
    "qwen3_asr_encoder": {"output_dim": HIDDEN},  # the audio features enter the text at its width
    # codecs' up-sampling convolutions are grouped: groups that divide the shrunk width
    "mimi": {"upsample_groups": HIDDEN},
    "pocket_tts_audio_tokenizer": {"upsample_groups": HIDDEN},
    "moonshine_streaming": {"num_key_value_heads": HEADS},  # the decoder reads it, its default lacks it
}


OVERRIDES["seamless_m4t_v2"] = OVERRIDES["seamless_m4t"]

# per-family model classes where the auto mapping's base class does not take the family's config
# (MusicGen's MODEL_MAPPING entry is the decoder alone, which wants the decoder's config)
CLASSES: dict[str, str] = {
    "musicgen": "MusicgenForConditionalGeneration",
    "musicgen_melody": "MusicgenMelodyForConditionalGeneration",
    # SpeechT5's base model has no pre-net: its inputs are hidden states; speech to text reads a waveform
    "speecht5": "SpeechT5ForSpeechToText",
}
