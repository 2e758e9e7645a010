"""vLLM's engine alone on a burst: every prompt at once through `vllm.LLM.generate`, greedy, EOS
ignored; the peer's offline figure beside which its served burst is read.

Run by `peer_vllm.run_vllm_offline` with the peer environment's interpreter (it imports vLLM
only, none of this project). Argument 1: a JSON file {"model", "dtype", "max_model_len",
"gpu_memory_utilization", "prompts" (lists of token ids), "output_tokens", "rounds"}; argument 2:
where to write {"tokens_per_s": [one per round], "output_tokens": [...], "elapsed_s": [...]}.
Each round sends the same prompts with the prefix cache reset first; the first round after a
short warm-up, as the served runs have theirs.
"""

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              gpu_memory_utilization=spec["gpu_memory_utilization"])
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in spec["prompts"]]
    params = SamplingParams(max_tokens=spec["output_tokens"], ignore_eos=True, temperature=0)
    warm = [TokensPrompt(prompt_token_ids=list(reversed(ids))) for ids in spec["prompts"][:4]]
    llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0), use_tqdm=False)
    result = {"tokens_per_s": [], "output_tokens": [], "elapsed_s": []}
    for _ in range(spec["rounds"]):
        llm.reset_prefix_cache()
        started_s = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed_s = time.perf_counter() - started_s
        tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
        result["tokens_per_s"].append(tokens / elapsed_s)
        result["output_tokens"].append(tokens)
        result["elapsed_s"].append(elapsed_s)
        print(f"vLLM offline: {tokens} tokens in {elapsed_s:.2f} s", flush=True)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is required
    main()
