"""`python -m models`: load every zoo model (training any that has no checkpoint yet) and show
what each one produces."""

from __future__ import annotations

import argparse

import torch

from . import CONVERTED, checkpoint_path, load, module, names


def _training(model: torch.nn.Module, trained_now: bool) -> str:
    info = model.train_info
    if info.get("source"):  # smollm2: published weights, converted
        when = "converted to float32 just now" if trained_now else "its float32 conversion"
        return f"not trained by probe: {info['source']}, {when}"
    if not info["steps"]:
        return "not trained: seeded init"
    when = "trained just now" if trained_now else "checkpoint"
    return (
        f"{when}: {info['steps']} steps in {info['train_seconds']:.1f} s, final loss {info['final_loss']:.6f}"
    )


def _show(name: str, model: torch.nn.Module) -> None:
    if name == "single_head":
        x = module(name).example_input()
        with torch.no_grad():
            out, wei = model(x)
        print(f"  x {tuple(x.shape)} -> out {tuple(out.shape)}, wei {tuple(wei.shape)}")
        print("  wei[0] (each row sums to 1; zeros above the diagonal are the causal mask):")
        for row in wei[0]:
            print("    " + " ".join(f"{w:.2f}" for w in row.tolist()))
    elif name == "minigpt":
        print(f'  160 characters sampled after "at": {model.generate_text("at", 160)!r}')
    elif name == "fused_decoder":
        digits = "3141592653"
        print(f"  next-digit predictions for {digits}: {model.predict(digits)}")
        print("  (the task's digits are independent random draws: nothing better than chance")
        print("   is learnable, the loss stays near ln 10 = 2.303)")
    elif name == "translator":
        source = "ich mochte ein bier"
        print(f"  {source} -> {model.translate(source)}")
    elif name == "aligner":
        source = "gestern sah der junge das hundehaus"
        print(f"  {source} -> {model.translate(source)}")
    elif name == "vit_zoo":
        from . import shapes

        data = shapes.generate(6, seed=10_000)
        truth = [shapes.CLASSES[i] for i in data.labels]
        said = model.classify(list(data.images))
        print(f"  6 held-out pictures of {', '.join(truth)} -> {', '.join(said)}")
    elif name == "induction":
        from . import induction

        segment = "wh4t+COMES/nexT"  # 15 distinct tokens
        guess = model.predict("^" + segment + segment)  # guess[t]: its guess for token t + 1
        n = len(segment)
        print(f"  ^ then {segment} twice; the guess for each token after the first of a copy:")
        print(f"    first copy:  {segment[1:]} -> {guess[1:n]}  (nothing to go on)")
        print(f"    second copy: {segment[1:]} -> {guess[n + 1 : 2 * n]}  (looks back)")
        acc = induction.accuracy(model)
        print(
            f"  next-token accuracy on 64 random ^ r r (|r| = 31): first copy {acc['first']:.2f} "
            f"(chance 1/64), second copy {acc['second']:.2f}"
        )
    elif name == "speech":
        from . import speech_data

        for s in speech_data.test_set()[:2]:
            said = model.transcribe(s.audio)[0]
            print(f"  held-out sentence {s.seed} ({s.seconds:.2f} s): {s.text!r} -> {said!r}")
    elif name == "smollm2":
        prompt = "The capital of France is"
        ids = model.tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=8, do_sample=False)
        said = model.tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        print(f"  greedy after {prompt!r}: {said!r}")


def main(argv: list[str] | None = None) -> int:
    """Run the demo; ``argv`` are command-line arguments (only ``--help``), none when called from code."""
    parser = argparse.ArgumentParser(
        prog="python -m models",
        description="Load every model of the probe zoo (training any that has no checkpoint yet: the "
        "translator trains about 30 steps, with a progress bar, and writes its 177 MB checkpoint into "
        "~/.cache/probe, or $PROBE_CACHE_DIR; smollm2 is converted once from its package's GGUF file "
        "into a 538 MB folder there) and show what each one produces.",
        epilog="retrain one model: python -m models.train NAME; list them: probe models",
    )
    parser.parse_args(argv or [])
    from probe.errors import ProbeError

    for name in names():
        trained_now = not checkpoint_path(name).exists()
        try:
            model = load(name)
        except ProbeError as err:  # smollm2 without its package: say how to install it, go on
            if name not in CONVERTED:
                raise
            print(f"{name}: not installed: {err}\n")
            continue
        n_params = sum(p.numel() for p in model.parameters())
        summary = (module(name).__doc__ or "").strip().splitlines()[0]
        print(f"{name}: {summary}")
        print(f"  {n_params:,} parameters; {_training(model, trained_now)}")
        _show(name, model)
        print()
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
