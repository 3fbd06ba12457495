"""The trainer's side of SGLang's distributed weight-update protocol, as a separate process for
``test_rollout_weight_sync.py`` (a reference written from SGLang's protocol, not through ``areal_fast.weights``)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    """Trainer side of the weight-update protocol, for tests (run as a separate process).

    ``python tests/rollout/reference_sender.py SPEC``
    where SPEC is a JSON file: {"url", "master_port", "group_name", "result_path",
    "rounds": [{"tensors", "version", "load_format", "dtype", "silent"}], "probe": [prompt ids],
    "probe_new_tokens"} and each round's "tensors" is a safetensors file of HF-named tensors (no
    transformers import here). Rank 0 hosts the TCP store; the server joins as rank 1 (world size 2).
    Servers >= 0.5.21 get begin_weight_update / end_weight_update around each round. For each round
    the HTTP update call is sent from a thread (not awaited) and the broadcasts follow in ``names``
    order; a "silent" round sends none (the server's wait must end by itself). After every round a
    greedy probe generation's output ids and weight_version are recorded.
    """
    import json
    import os
    import sys
    import time

    import torch
    import torch.distributed as dist
    from packaging.version import Version

    from areal_fast.backends.sglang.compat import needs_weight_update_sessions
    from areal_fast.embedded.weight_sync import TensorMeta, flattened_bucket_layout, init_custom_process_group
    from areal_fast.rollout.calls import BlockingCalls

    spec = json.load(open((argv or sys.argv[1:])[0]))
    url, group = spec["url"], spec["group_name"]

    calls = BlockingCalls()  # the one module for calls to servers; its loop runs in a thread

    async def post_async(c, path: str, body: dict):
        status, out = await c.request(url, "POST", path, body, timeout_s=120)
        if status >= 400:  # the answer, marked with its status (the tests look at refusals)
            out = {**out, "http_error": status} if isinstance(out, dict) else {"http_error": status, "body": out}
        return out

    def send(path: str, body: dict):
        """Sent from the calls' thread, not awaited (the broadcasts follow); its Future."""
        return calls.run(lambda c: post_async(c, path, body))

    def post(path: str, body: dict):
        return send(path, body).result()

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sessions = needs_weight_update_sessions(Version(calls.call(url, "GET", "/server_info")["version"]))
    sent = send("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": spec["master_port"], "rank_offset": 1, "world_size": 2,
        "group_name": group, "backend": "gloo"})
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{spec['master_port']}", 2, 0, group)
    results = {"init": sent.result(), "rounds": []}
    for rnd in spec["rounds"]:
        from safetensors.torch import load_file

        sd = load_file(rnd["tensors"])
        dtype = getattr(torch, rnd.get("dtype", "float32"))
        names = list(sd)
        tensors = [sd[n].to(dtype) for n in names]
        body = {"names": names, "dtypes": [str(x.dtype).removeprefix("torch.") for x in tensors],
                "shapes": [list(x.shape) for x in tensors], "group_name": group, "flush_cache": True,
                "abort_all_requests": False, "weight_version": rnd["version"], "load_format": rnd["load_format"]}
        if sessions:
            post("/begin_weight_update", {})
        t0 = time.monotonic()
        sent = send("/update_weights_from_distributed", body)
        if rnd.get("silent"):
            pass
        elif rnd["load_format"] == "flattened_bucket":
            metas = [TensorMeta(n, x.dtype, tuple(x.shape)) for n, x in zip(names, tensors)]
            offsets, total = flattened_bucket_layout(metas)
            buf = torch.zeros(total, dtype=torch.uint8)
            for off, x in zip(offsets, tensors):
                raw = x.contiguous().view(-1).view(torch.uint8)
                buf[off:off + raw.numel()] = raw
            dist.broadcast(buf, src=0, group=pg)
        else:
            for x in tensors:
                dist.broadcast(x.contiguous(), src=0, group=pg)
        answer = sent.result()
        waited = time.monotonic() - t0
        if sessions:
            post("/end_weight_update", {})
        probe = post("/generate", {"input_ids": spec["probe"], "sampling_params": {
            "max_new_tokens": spec["probe_new_tokens"], "temperature": 0.0, "ignore_eos": True}})
        results["rounds"].append({"update": answer, "waited_s": waited, "output_ids": probe["output_ids"],
                                  "weight_version": probe["meta_info"]["weight_version"]})
    results["destroy"] = post("/destroy_weights_update_group", {"group_name": group})
    calls.close()
    dist.destroy_process_group(pg)
    with open(spec["result_path"], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
