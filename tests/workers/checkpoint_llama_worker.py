"""A transformers Llama built under auto_parallelize trains two steps, is saved with
axonn_c.checkpoint, exported to a serial state dict on rank 0 and loaded into the plain
transformers model, whose logits must equal the parallel model's (tests/test_checkpoint.py)."""
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import axonn_c
import axonn_c.checkpoint as ckpt


def main():
    path = sys.argv[1]
    g = axonn_c.init(G_intra_c=2, G_intra_d=int(os.environ["WORLD_SIZE"]) // 2)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=40, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with axonn_c.auto_parallelize():
        model = LlamaForCausalLM(cfg)
    n = sum(isinstance(m, axonn_c.Linear) for m in model.modules())
    assert n == 8, f"{n} layers sharded"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(g.rank)
    for _ in range(2):
        ids = torch.randint(0, 32, (2, 8), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        axonn_c.sync_gradients(model, mean=True)
        opt.step()
        opt.zero_grad()
    ckpt.save(path, model, opt)
    probe = torch.arange(8).reshape(1, 8) % 32
    with torch.no_grad():
        want = model(input_ids=probe).logits
    if g.rank == 0:
        serial = LlamaForCausalLM(cfg)
        serial.load_state_dict(ckpt.export(path), strict=True)
        with torch.no_grad():
            got = serial(input_ids=probe).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        print("LLAMA LOGITS MATCH", flush=True)
    axonn_c.finalize()


if __name__ == "__main__":
    main()
