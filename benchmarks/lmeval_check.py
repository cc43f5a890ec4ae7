"""lm-evaluation-harness against `slipstream serve`, checked: its `local-completions` model scores continuations
through /v1/completions (token ids, `echo`, `logprobs`), and this tool recomputes every loglikelihood it logged with
transformers in f32 on the same GGUF weights. No harness data is downloaded: the task is
benchmarks/data/lmeval/facts.yaml (20 handwritten multiple-choice facts). From the repo root, with lm-eval installed
somewhere on PYTHONPATH (`pip install --target DIR lm-eval` plus its dependencies, torch excepted):

    .venv/bin/python -m benchmarks.lmeval_check tokenizer /tmp/smol-tok     # the default model's tokenizer, HF form
    make serve &                                                             # the default model on :8000
    python -m lm_eval --model local-completions --model_args model=smollm2-135m-instruct,base_url=http://127.0.0.1:8000/v1/completions,tokenizer_backend=huggingface,tokenizer=/tmp/smol-tok,num_concurrent=4 \\
        --include_path benchmarks/data/lmeval --tasks slipstream_facts --output_path /tmp/lme-out --log_samples
    .venv/bin/python -m benchmarks.lmeval_check compare /tmp/lme-out/*/samples_slipstream_facts_*.jsonl
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np


def write_tokenizer(out: str) -> None:
    """The default model's tokenizer as an HF tokenizer directory (what lm-eval's huggingface backend loads)."""
    from slipstream.models.registry import DEFAULT_MODEL, load_tokenizer, resolve_model

    os.makedirs(out, exist_ok=True)
    load_tokenizer(resolve_model(DEFAULT_MODEL))._hf.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)


def compare(samples: str, tokenizer: str) -> None:
    """Each logged (context, continuation) loglikelihood against transformers f32 on the default model's GGUF."""
    import torch
    import transformers

    from slipstream.models.registry import DEFAULT_MODEL, resolve_model

    path = resolve_model(DEFAULT_MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                              torch_dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    worst, agree, n = 0.0, 0, 0
    with open(samples, encoding="utf-8") as f:
        for line in f:
            sample = json.loads(line)
            served = [float(r[0][0]) for r in sample["resps"]]
            ref = []
            for args in sample["arguments"].values():
                context = tok(args["arg_0"]).input_ids  # lm-eval's split: the context's ids, then the rest
                whole = tok(args["arg_0"] + args["arg_1"]).input_ids
                with torch.no_grad():
                    lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
                ref.append(float(sum(lp[i - 1, whole[i]] for i in range(len(context), len(whole)))))
            worst = max(worst, max(abs(a - b) for a, b in zip(ref, served)))
            agree += int(np.argmax(ref) == np.argmax(served))
            n += 1
    print(f"{n} questions: max |loglikelihood difference| against transformers f32 on the same GGUF {worst:.4f}; "
          f"the same choice on {agree}/{n}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("tokenizer").add_argument("out")
    cmp = sub.add_parser("compare")
    cmp.add_argument("samples")
    cmp.add_argument("--tokenizer", default="/tmp/smol-tok")
    args = parser.parse_args()
    if args.cmd == "tokenizer":
        write_tokenizer(args.out)
    else:
        compare(args.samples, args.tokenizer)


if __name__ == "__main__":
    main()
