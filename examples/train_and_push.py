"""Train a small Qwen3 with FSDP2 + AdamW on 2 ranks; after every optimizer step push the new
weights one-sidedly into 2 inference ranks (TP 2, bf16 from the fp32 master) and verify them.
Run: python examples/train_and_push.py [STEPS]    (README: "Use it in your own trainer")"""
import os, shutil, sys, tempfile, torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen3Config, Qwen3ForCausalLM
import weight_transfer as wt
from weight_transfer.engines import Engine, expected_from_checkpoint
from weight_transfer.testing.catalog import load_config

N_TRAIN, N_INFER, STEPS = 2, 2, int(sys.argv[1]) if len(sys.argv) > 1 else 3
CFG = load_config("qwen3-0.6b", num_hidden_layers=2, vocab_size=8192)  # the real architecture, 2 layers
LAYOUT, OUT = wt.InferenceLayout(tp=2), os.environ.get("WT_EXAMPLE_DIR", "")  # the launcher sets it

def trainer(rank, addr):
    torch.set_num_threads(1); store = wt.connect_store(addr)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=N_TRAIN)
    torch.manual_seed(0); model = Qwen3ForCausalLM(Qwen3Config(**CFG.hf))  # fp32 master weights
    mesh = init_device_mesh("cpu", (N_TRAIN,))
    for layer in model.model.layers: fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    coord = wt.Coordinator(store, n_train=N_TRAIN, n_infer=N_INFER, model_config=CFG, layout=LAYOUT) if rank == 0 else None
    sender = wt.Sender(model, rank=rank, world_size=N_TRAIN, store=store, coordinator=coord)
    text = (torch.arange(4 * 64) * 7 % 101).view(4, 64)[rank::N_TRAIN]  # this rank's half of the batch
    for step in range(1, STEPS + 1):
        loss = model(input_ids=text, labels=text).loss
        loss.backward(); opt.step(); opt.zero_grad()
        sender.push(version=step)                                         # <- the whole integration
        full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}  # for the check only
        if rank == 0:
            torch.save(full, f"{OUT}/v{step}.pt"); store.set(f"saved/{step}", b"1"); u = sender.last_update
            store.wait([f"ok/{step}/{i}" for i in range(N_INFER)])
            ok = all(store.get(f"ok/{step}/{i}") == b"1" for i in range(N_INFER))
            print(f"step {step}: loss {loss.item():.4f}, pushed {u.bytes / 1e6:.1f} MB in {u.seconds:.3f} s "
                  f"({u.gbps:.2f} GB/s), {'verified' if ok else 'MISMATCH'} on {N_INFER} inference ranks", flush=True)
            assert ok
    sender.close(); dist.destroy_process_group()

def inference(rank, addr):
    torch.set_num_threads(1); store, engine = wt.connect_store(addr), Engine(CFG, LAYOUT, rank)
    receiver = wt.Receiver.from_arena(engine.arena, engine.tensor_metas(), rank=rank, store=store)
    for step in range(1, STEPS + 1):
        receiver.wait_version(step)  # then copy what this rank holds, with no write in between
        _, got = receiver.read_consistent(lambda: {n: t.clone() for n, t in engine.named_parameters().items()})
        store.wait([f"saved/{step}"]); full = torch.load(f"{OUT}/v{step}.pt", weights_only=True)
        want = expected_from_checkpoint(CFG, LAYOUT, rank, full.__getitem__, list(full)).named_parameters()
        same = all(torch.equal(t.view(torch.uint8), want[n].view(torch.uint8)) for n, t in got.items())
        store.set(f"ok/{step}/{rank}", b"1" if same else b"0")
    receiver.close()

if __name__ == "__main__":
    made = not OUT; OUT = os.environ["WT_EXAMPLE_DIR"] = OUT or tempfile.mkdtemp(prefix="wt-ex-")  # the checkpoints
    store = wt.serve_store("127.0.0.1", 0); addr = ("127.0.0.1", store.port); ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=trainer, args=(r, addr)) for r in range(N_TRAIN)]
    procs += [ctx.Process(target=inference, args=(i, addr)) for i in range(N_INFER)]; [p.start() for p in procs]
    while any(p.is_alive() for p in procs) and not any(p.exitcode for p in procs): procs[0].join(0.2)
    for p in procs: p.terminate() if any(q.exitcode for q in procs) else None; p.join()  # one failed: stop the rest
    shutil.rmtree(OUT, ignore_errors=True) if made else None; sys.exit(max(abs(p.exitcode or 0) for p in procs))
