"""``probe generate``: generate from a prompt, capture what every new token read, write the cache
and the report."""

from __future__ import annotations

import argparse
from pathlib import Path

from probe.cli import common
from probe.cli.common import add_image_args, add_model_args, examples
from probe.errors import ProbeError
from probe.files import human_size

CACHE_NAME = "generation.safetensors"
DEFAULT_NEW = 32


def _keep(text: str):
    """``--keep``: ``patterns`` (default), ``rows`` (the row of every generated token), ``topk:k``
    (and the other forms ``probe capture --keep`` takes)."""
    if text in ("rows", "stats"):
        return text  # probe.generate's own per-step forms
    from probe.capture.consumers.kept import parse_keep_arg

    return parse_keep_arg(text)


def _default_new(model, tok, prompt: str) -> int:
    """``--max-new-tokens`` left out: :data:`DEFAULT_NEW`, or what a zoo model's context leaves
    room for after the prompt (minigpt reads 32 positions, the translator 16 target tokens)."""
    limit = getattr(model, "context_length", None)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return DEFAULT_NEW
    if getattr(model, "is_encoder_decoder", False):
        return max(1, min(DEFAULT_NEW, limit - 1))
    if not callable(getattr(tok, "encode", None)):
        return DEFAULT_NEW
    from probe.capture.inputs.tokenizers import adapt  # probe's encoding: an untokenizable prompt is one line

    return max(1, min(DEFAULT_NEW, limit - len(adapt(tok).encode(prompt).ids) + 1))


def _sampling(args: argparse.Namespace) -> dict:
    """``--seed`` or ``--temperature``: sample (``do_sample``, the temperature); else greedy."""
    t = args.temperature
    if t is not None and not t > 0:
        raise ProbeError(f"--temperature must be above 0 (1 samples the model's own softmax), got {t}")
    if args.seed is None and t is None:
        return {}
    return {"do_sample": True, **({"temperature": t} if t is not None else {})}


def _strategy(args: argparse.Namespace) -> str:
    """How the tokens were chosen, for the output line: greedy, or sampled under which seed."""
    if args.seed is None and args.temperature is None:
        return "greedy"
    seed = f"seed {args.seed}" if args.seed is not None else "no seed: not reproducible"
    return f"sampled, {seed}, temperature {args.temperature if args.temperature is not None else 1:g}"


def _out_dir(args: argparse.Namespace) -> Path:
    from probe.cli.report import report_name

    if args.output:
        return Path(args.output)
    return Path("reports") / report_name(f"{common.model_label(args)}_generate")


def cmd_generate(args: argparse.Namespace) -> int:
    import probe
    from probe.cache.writer import check_output
    from probe.report.html import check_report_dir

    if len(args.prompt) != 1:
        raise ProbeError(
            "give one PROMPT (quote it: probe generate --model minigpt 'attention lets')"
            if args.prompt
            else "nothing to generate from; give a PROMPT"
        )
    if isinstance(args.max_new_tokens, int) and args.max_new_tokens < 1:
        raise ProbeError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    keep = _keep(args.keep)  # refused before the model loads
    out = _out_dir(args)
    check_report_dir(out)  # before loading the model and generating
    cache_path = out / CACHE_NAME
    check_output(cache_path)
    kwargs = _sampling(args)
    if args.image:  # pictures and the text around them: a vision-language model's own processor
        model, tok, processor = common.load_image_model(args, text=True, writes=True)
        prompt, kwargs = args.image, dict(kwargs, processor=processor, text=args.prompt[0])
    else:
        model, tok = common.load_model(args, writes=True)
        prompt = args.prompt[0]
    n = args.max_new_tokens if args.max_new_tokens is not None else _default_new(model, tok, args.prompt[0])
    gen = probe.generate(
        model,
        prompt,
        max_new_tokens=n,
        tokenizer=tok,
        keep=keep,
        seed=args.seed,
        **kwargs,
    )
    out.mkdir(parents=True, exist_ok=True)
    gen.save(cache_path)
    shown = gen.text if gen.text is not None else " ".join(str(i) for i in gen.new_ids[0].tolist())
    print(f"generated {gen.new_ids.shape[1]} tokens ({_strategy(args)}): {shown}")
    size = f"{cache_path} ({human_size(cache_path.stat().st_size)})"
    if args.no_report:
        print(f"wrote {size}; report it later with `probe report {cache_path}`")
        return 0
    path = probe.report(gen.cache, out, model=model, tokenizer=tok, progress=not args.quiet)
    print(f"wrote {size} and {path} ({human_size(path.stat().st_size)})")
    print(f"open the report in a browser: {path.resolve().as_uri()}")
    return 0


def add_parser(sub) -> None:
    """``probe generate``."""
    p = sub.add_parser(
        "generate",
        help="generate from a prompt and write what every new token read (cache and report)",
        description="Run a model's own generation from PROMPT (greedy, or sampled under --seed and "
        "--temperature), capture "
        "what every generated token attended to as the model ran (through its KV cache where it has "
        "one), and write the cache (OUT/generation.safetensors) and an offline HTML report "
        "(OUT/index.html) whose generation section shows the output: hover a generated token to see "
        "what it read, and each head's lookback ratio over the steps.",
        epilog=examples(
            "probe generate --model minigpt 'at' --max-new-tokens 30",
            "probe generate --model minigpt 'attention lets' --max-new-tokens 12 --seed 7 --temperature 1.5",
            "probe generate --model translator 'ich mochte ein bier' -o reports/beer",
            "probe generate --hf ./my-gpt2 'The attention' --max-new-tokens 200 --keep rows",
            "probe generate --hf ./my-llama 'The attention' --max-new-tokens 2000 --keep topk:16",
            "probe generate --hf ./my-llava --image cat.png 'USER: <image> what is it? ASSISTANT:' -n 20",
        ),
    )
    p.add_argument("prompt", nargs="*", metavar="PROMPT", help="the prompt (one text)")
    add_model_args(p)
    add_image_args(
        p,
        "a picture the PROMPT's image tokens stand for (several in their order); the "
        "--hf folder's processor places them",
    )
    p.add_argument(
        "--max-new-tokens",
        "-n",
        type=int,
        default=None,
        help=f"tokens to generate at most (default {DEFAULT_NEW}, or what a zoo model's context "
        "leaves room for)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sample from the model's softmax under this seed (default: greedy decoding); a model sure "
        "of every next token samples its greedy output: --temperature above 1 flattens the softmax",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        metavar="T",
        help="sample from softmax(logits / T) (samples even without --seed, then not reproducibly; "
        "default 1 when sampling)",
    )
    p.add_argument(
        "--keep",
        default="patterns",
        metavar="WHAT",
        help="what to keep of each attention: 'patterns' (default: the whole causal pattern over "
        "prompt + output), 'rows' (the row of every generated token over every key, no whole pattern) "
        "'topk:16' (the 16 largest weights of every row) or 'stats' (each head's statistics), for long "
        "generations",
    )
    p.add_argument(
        "-o",
        "--output",
        default=None,
        help="folder for the cache and report (default: reports/<model>_generate/)",
    )
    p.add_argument("--no-report", action="store_true", help="write the cache only (no index.html)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_generate)
