"""One forward pass over a mixed batch of decode tokens and prompt chunks, with a KV cache the engine owns.

Hugging Face's generic forward wants one padded rectangle per call and a cache per batch, which cannot
express "sequence A decodes its 40th token while sequence B reads the second chunk of its prompt". Like
TensorRT-LLM and vLLM, we run the Llama-family forward ourselves over the checkpoint's own modules (the
embedding, RMSNorms, projections, MLP and rotary tables are Hugging Face's; only attention and the cache
are ours), so every step is one packed forward for all active sequences:

- all tokens of the step go through the linear layers together, as one [T, hidden] matrix;
- each token's K/V is written into its sequence's slot of a cache preallocated once
  ([slots, kv_heads, max_seq_len, head_dim] per layer);
- decode tokens attend as one batch (keys gathered per slot, masked per sequence length); each prompt
  chunk attends on its own with a causal mask offset by what its sequence already has in cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from cpu_engine.config import EngineConfig

# Architectures whose decoder layer is Llama's: RMSNorm, rotary, GQA attention (optional q/k/v bias,
# optional per-head q/k norm), gated MLP.
LLAMA_FAMILY = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Chunk:
    """`length` new tokens of the sequence in `slot`, whose cache already holds `start` tokens."""

    slot: int
    start: int
    length: int


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaRunner:
    """Owns the weights and the KV cache; knows nothing about requests or sampling."""

    def __init__(self, config: EngineConfig):
        hf_config = AutoConfig.from_pretrained(config.checkpoint_dir)
        architectures = getattr(hf_config, "architectures", None) or []
        if not LLAMA_FAMILY.intersection(architectures):
            raise ValueError(
                f"the CPU engine runs Llama-family checkpoints ({', '.join(sorted(LLAMA_FAMILY))}); "
                f"{config.checkpoint_dir} is {architectures or 'of unknown architecture'}"
            )
        if config.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {config.dtype!r}")
        self.dtype = DTYPES[config.dtype]
        self.model = AutoModelForCausalLM.from_pretrained(config.checkpoint_dir, dtype=self.dtype)
        self.model.eval()
        decoder = self.model.model
        self.embed = decoder.embed_tokens
        self.layers = list(decoder.layers)
        self.norm = decoder.norm
        self.rotary = decoder.rotary_emb
        self.lm_head = self.model.lm_head
        self.vocab_size = int(hf_config.vocab_size)

        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.num_heads = int(hf_config.num_attention_heads)
        self.num_kv_heads = int(hf_config.num_key_value_heads)
        self.scale = float(attn.scaling)
        self.max_seq_len = config.max_seq_len
        self.num_slots = config.max_batch_size
        cache_shape = (len(self.layers), self.num_slots, self.num_kv_heads, self.max_seq_len, self.head_dim)
        self.k_cache = torch.zeros(cache_shape, dtype=self.dtype)
        self.v_cache = torch.zeros(cache_shape, dtype=self.dtype)

    @property
    def kv_cache_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    @torch.inference_mode()
    def forward(self, token_ids: list[int], decode_slots: list[int], decode_positions: list[int],
                chunks: list[Chunk], logits_rows: list[int]) -> torch.Tensor:
        """Run one step and return float32 logits for the packed rows in `logits_rows`.

        The packed batch is the decode tokens (one per entry of `decode_slots`, at `decode_positions`)
        followed by each chunk's tokens in order.
        """
        num_decode = len(decode_slots)
        positions = list(decode_positions)
        token_slots = list(decode_slots)
        for chunk in chunks:
            positions.extend(range(chunk.start, chunk.start + chunk.length))
            token_slots.extend([chunk.slot] * chunk.length)
        ids = torch.tensor(token_ids, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        slots = torch.tensor(token_slots, dtype=torch.long)
        num_tokens = ids.shape[0]

        hidden = self.embed(ids)
        cos, sin = self.rotary(hidden, pos[None, :])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [T, 1, head_dim]

        decode_mask = None
        if num_decode:
            dec_len = pos[:num_decode] + 1
            max_len = int(dec_len.max())
            decode_mask = (torch.arange(max_len)[None, :] < dec_len[:, None])[:, None, None, :]
            # Slots in one contiguous run (the usual case: the scheduler hands out the lowest free slots
            # and orders decodes by slot) are read as a view instead of gathered, layer after layer.
            first = decode_slots[0]
            contiguous = decode_slots == list(range(first, first + num_decode))
            dec_rows = slice(first, first + num_decode) if contiguous else slots[:num_decode]

        for layer_idx, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache, v_cache = self.k_cache[layer_idx], self.v_cache[layer_idx]
            k_cache[slots, :, pos] = k
            v_cache[slots, :, pos] = v

            outputs = []
            if num_decode:
                keys = k_cache[dec_rows, :, :max_len]  # [B, kv_heads, L, head_dim]
                values = v_cache[dec_rows, :, :max_len]
                out = F.scaled_dot_product_attention(
                    q[:num_decode, :, None, :], keys, values, attn_mask=decode_mask,
                    scale=self.scale, enable_gqa=True)
                outputs.append(out.reshape(num_decode, -1))
            offset = num_decode
            for chunk in chunks:
                end = chunk.start + chunk.length
                chunk_q = q[offset:offset + chunk.length].transpose(0, 1)[None]  # [1, heads, c, hd]
                keys = k_cache[chunk.slot, :, :end][None]
                values = v_cache[chunk.slot, :, :end][None]
                if chunk.start == 0:
                    out = F.scaled_dot_product_attention(
                        chunk_q, keys, values, is_causal=True, scale=self.scale, enable_gqa=True)
                else:
                    query_pos = torch.arange(chunk.start, end)[:, None]
                    mask = torch.arange(end)[None, :] <= query_pos
                    out = F.scaled_dot_product_attention(
                        chunk_q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
                outputs.append(out[0].transpose(0, 1).reshape(chunk.length, -1))
                offset += chunk.length
            attn_out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
            hidden = hidden + attn.o_proj(attn_out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))

        if not logits_rows:  # a step of prompt chunks that all end mid-prompt
            return torch.empty(0, self.vocab_size)
        last = self.norm(hidden[torch.tensor(logits_rows, dtype=torch.long)])
        return self.lm_head(last).float()
