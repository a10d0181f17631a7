"""The vLLM engine process: ``python -m megatron_logra.vllm_plugin.server --fd-in R --fd-out
W``, started by the trainer's ``megatron_logra.rollout.vllm_engine.VLLMEngine`` in the vLLM venv.

Requests and replies are pickled tuples of plain Python values over two pipes (the client's venv
and this one share no classes; sync records stay wire bytes). Each request is ``(method,
kwargs)``; each reply ``("ok", value)`` or ``("error", message)``. vLLM's own logs go to this
process's stdout / stderr, which the client sends to a log file.
"""

from __future__ import annotations

import argparse
import pickle
import traceback
from multiprocessing.connection import Connection
from typing import Any

from megatron_logra.vllm_plugin import VLLM_VERSION

EXTENSION = "megatron_logra.vllm_plugin.extension.LowRankSyncExtension"


def check_versions(client_protocol: int, engine_protocol: int, vllm_version: str) -> None:
    """Refuse an engine whose sync protocol or vLLM differs from what the client speaks."""
    if client_protocol != engine_protocol:
        raise RuntimeError(
            f"sync protocol mismatch: the trainer speaks version {client_protocol}, the vLLM venv's "
            f"megatron_logra {engine_protocol}; rebuild it from this checkout (make setup-vllm)")
    if vllm_version.split("+")[0] != VLLM_VERSION:
        raise RuntimeError(
            f"vLLM version mismatch: the plugin is written for vLLM {VLLM_VERSION}, the venv has "
            f"{vllm_version}; reinstall it (make setup-vllm)")


class Engine:
    def __init__(self) -> None:
        self.llm = None
        self.arch = None

    def start(self, *, protocol_version: int, hf_dir: str, tensor_parallel: int, dtype: str,
              max_model_len: int | None, seed: int, target_names: list[str],
              merge_device: str) -> dict[str, Any]:
        import vllm
        from vllm import LLM

        from megatron_logra.sync.wire import PROTOCOL_VERSION
        from megatron_logra.vllm_plugin.layout import ServedArch

        check_versions(protocol_version, PROTOCOL_VERSION, vllm.__version__)
        self.llm = LLM(model=hf_dir, dtype=dtype, tensor_parallel_size=tensor_parallel,
                       enforce_eager=True, max_model_len=max_model_len, block_size=32,
                       skip_tokenizer_init=True, seed=seed, enable_prefix_caching=True,
                       # A sample's log-prob at its sampling temperature, log softmax(z / T)
                       # (pi_rollout; top_p is 1 for a separate engine): vLLM's default,
                       # raw_logprobs, is log softmax(z) whatever T.
                       logprobs_mode="processed_logprobs",
                       worker_extension_cls=EXTENSION)
        self.arch = ServedArch.from_hf_config(self.llm.llm_engine.model_config.hf_config)
        workers = self.llm.collective_rpc("megatron_logra_init", args=(target_names, merge_device))
        replay = sorted({device for _, device in workers})
        return {"vllm_version": vllm.__version__, "served_dtype": workers[0][0],
                # One kind for all: a worker that cannot replay on the trainer's kind decides.
                "replay_device": merge_device if replay == [merge_device] else "cpu"}

    def generate(self, *, prompt_token_ids: list[list[int]], max_new_tokens: int,
                 temperature: float, top_p: float, seed: int) -> list[tuple[list[int], list[float]]]:
        from vllm import SamplingParams, TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_token_ids]
        # One seed per prompt: the same seed for all would correlate their samples.
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 seed=seed + i, logprobs=0, detokenize=False)
                  for i in range(len(prompts))]
        results = []
        for out in self.llm.generate(prompts, params, use_tqdm=False):
            sample = out.outputs[0]
            tokens = list(sample.token_ids)
            results.append((tokens, [step[t].logprob for t, step in zip(tokens, sample.logprobs, strict=True)]))
        return results

    def score(self, *, token_ids: list[list[int]]) -> list[list[float]]:
        """Log-probs of each sequence's tokens 1..L-1 given the ones before (prompt logprobs)."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(t)) for t in token_ids],
                                 params, use_tqdm=False)
        return [[step[t].logprob for t, step in zip(seq[1:], out.prompt_logprobs[1:], strict=True)]
                for seq, out in zip(token_ids, outs, strict=True)]

    def apply_sync(self, *, payload: bytes) -> list[str]:
        return self._applied(self.llm.collective_rpc("megatron_logra_apply", args=(payload,)))

    def open_channel(self, *, address: dict[str, Any]) -> list[int]:
        """``sync.transport=collective``: every worker joins the trainer's channel."""
        return self.llm.collective_rpc("megatron_logra_open_channel", args=(address,))

    def sync_collective(self, *, header: bytes, nbytes: int) -> dict[str, Any]:
        """Every worker receives the record's tensor bytes from the trainer's broadcast (only
        the header passes through here) and applies it."""
        replies = self.llm.collective_rpc("megatron_logra_apply_collective",
                                          args=(header, nbytes))
        digests = sorted({digest for _, _, digest in replies})
        names = self._applied([(status, value) for status, value, _ in replies])
        if len(digests) != 1:
            raise RuntimeError(f"the vLLM workers rebuilt different records: digests {digests}")
        return {"names": names, "digest": digests[0]}

    def _applied(self, replies: list[tuple[str, Any]]) -> list[str]:
        errors = sorted({value for status, value in replies if status == "error"})
        if errors:
            # Every worker checks a record before changing anything, so all refuse alike.
            raise RuntimeError("; ".join(errors))
        names = replies[0][1]
        if names:
            # Cached prefixes hold keys and values computed with the old weights: without the
            # reset, a long prompt's log-probs were measured ~2 nats off after an update.
            self.llm.reset_prefix_cache()
        return names

    def weight_checksums(self) -> dict[str, str]:
        from megatron_logra.sync.checksum import weight_checksums
        from megatron_logra.vllm_plugin.extension import load_served
        from megatron_logra.vllm_plugin.layout import hf_from_vllm_shards

        shards = [load_served(b) for b in self.llm.collective_rpc("megatron_logra_served")]
        return weight_checksums(sorted(hf_from_vllm_shards(shards, self.arch).items()))

    def update_counts(self) -> dict[str, int]:
        return self.llm.collective_rpc("megatron_logra_counts")[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd-in", type=int, required=True)
    parser.add_argument("--fd-out", type=int, required=True)
    args = parser.parse_args()
    requests = Connection(args.fd_in, writable=False)
    replies = Connection(args.fd_out, readable=False)
    engine = Engine()
    while True:
        try:
            method, kwargs = pickle.loads(requests.recv_bytes())
        except EOFError:
            return  # the client went away
        if method == "close":
            replies.send_bytes(pickle.dumps(("ok", None)))
            return
        try:
            reply = ("ok", getattr(engine, method)(**kwargs))
        except Exception as error:  # noqa: BLE001 -- every failure goes back to the client
            traceback.print_exc()
            reply = ("error", f"{type(error).__name__}: {error}")
        replies.send_bytes(pickle.dumps(reply))


if __name__ == "__main__":
    main()
