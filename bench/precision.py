"""Precision and device: trainer and generation tokens/s in float32 and bfloat16, and the first-step ratio check.

For every device this machine has (the CPU; CUDA when present, or only CUDA with ``--cuda``,
which ``make gpu-check`` passes) and both compute dtypes, prints one JSON line per figure:
``trainer_tokens_per_s``, ``generation_tokens_per_s`` (the base model, and on a LoRA adapter of
``--lora-rank``) and ``initial_ratio_max_abs_dev`` (the largest |log ratio| between the server's
sampled logprobs and the trainer's recomputation of the same tokens with the same weights; its
bound is ``agentstream.models.precision.INITIAL_RATIO_BOUND``).
"""

from __future__ import annotations

import argparse
import sys

import torch

from agentstream.gpu_check import generation_tokens_per_s, initial_ratio_max_abs_dev, trainer_tokens_per_s
from agentstream.models.precision import INITIAL_RATIO_BOUND
from bench.common import emit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="model spec: tiny (default), smollm2 or a HF folder")
    parser.add_argument("--cuda", action="store_true", help="CUDA only, and fail when there is none")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=256, help="tokens per trained sequence")
    parser.add_argument("--lora-rank", type=int, default=16,
                        help="generation is also measured on a random adapter of this rank (as a served checkpoint)")
    args = parser.parse_args()
    if args.cuda and not torch.cuda.is_available():
        print("bench.precision --cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    devices = ["cuda"] if args.cuda else ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    failed = False
    for device in devices:
        name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        for dtype in ("float32", "bfloat16"):
            extra = {"device": name, "dtype": dtype, "model": args.model}
            emit("precision", "trainer_tokens_per_s",
                 trainer_tokens_per_s(args.model, device, dtype, batch=args.batch, length=args.length),
                 "tokens/s", batch=args.batch, length=args.length, **extra)
            for rank in (0, args.lora_rank):
                emit("precision", "generation_tokens_per_s",
                     generation_tokens_per_s(args.model, device, dtype, batch=args.batch, lora_rank=rank), "tokens/s",
                     lora_rank=rank, **extra)
            deviation = initial_ratio_max_abs_dev(args.model, device, dtype)
            within = deviation < INITIAL_RATIO_BOUND[dtype]
            failed |= not within
            emit("precision", "initial_ratio_max_abs_dev", deviation, "|log ratio|", unrounded=deviation,
                 bound=INITIAL_RATIO_BOUND[dtype], within_bound=within, **extra)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
