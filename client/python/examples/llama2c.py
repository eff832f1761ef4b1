"""A llama2.c checkpoint (legacy format) in torch, fp32: enough to prefill and decode.

Matches kvc's C++ reference (client/model): RMSNorm eps 1e-5, RoPE on pairs (2i, 2i+1) with
frequency 10000^(-2i/head_dim), angles in double, GQA attention, SwiGLU FFN.
"""

import struct

import numpy as np
import torch


class Llama2c:
    def __init__(self, path):
        with open(path, "rb") as f:
            header = struct.unpack("7i", f.read(28))
            data = np.fromfile(f, dtype=np.float32)
        dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = header
        shared = vocab > 0
        vocab = abs(vocab)
        self.dim, self.hidden, self.n_layers = dim, hidden, n_layers
        self.n_heads, self.n_kv_heads, self.vocab, self.seq_len = n_heads, n_kv, vocab, seq_len
        self.head_dim = dim // n_heads
        kv_dim = self.head_dim * n_kv
        off = 0

        def take(*shape):
            nonlocal off
            n = int(np.prod(shape))
            t = torch.from_numpy(data[off:off + n].copy()).reshape(shape)
            off += n
            return t
        self.emb = take(vocab, dim)
        self.rms_att = take(n_layers, dim)
        self.wq = take(n_layers, dim, dim)
        self.wk = take(n_layers, kv_dim, dim)
        self.wv = take(n_layers, kv_dim, dim)
        self.wo = take(n_layers, dim, dim)
        self.rms_ffn = take(n_layers, dim)
        self.w1 = take(n_layers, hidden, dim)
        self.w2 = take(n_layers, dim, hidden)
        self.w3 = take(n_layers, hidden, dim)
        self.rms_final = take(dim)
        take(seq_len, self.head_dim // 2)
        take(seq_len, self.head_dim // 2)
        self.cls = self.emb if shared else take(vocab, dim)
        inv = 10000.0 ** (-2.0 * np.arange(self.head_dim // 2) / self.head_dim)
        self._inv_freq = inv  # float64, as the C++ reference computes angles

    @staticmethod
    def _rms(x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w

    def rope(self, x, positions):
        """x [T, heads, head_dim] rotated at positions [T] (pairs 2i, 2i+1)."""
        angles = np.outer(np.asarray(positions, dtype=np.float64), self._inv_freq)
        cs = torch.from_numpy(np.cos(angles).astype(np.float32))[:, None, :]
        sn = torch.from_numpy(np.sin(angles).astype(np.float32))[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = a * cs - b * sn
        out[..., 1::2] = a * sn + b * cs
        return out

    def _ffn(self, x, l):
        h = self._rms(x, self.rms_ffn[l])
        return x + (torch.nn.functional.silu(h @ self.w1[l].T) * (h @ self.w3[l].T)) @ self.w2[l].T

    def prefill(self, tokens):
        """Causal pass over tokens at positions 0..T-1: (logits [T, vocab], per layer (q, k, v)
        post-RoPE in HND: q [n_heads, T, hd], k and v [n_kv_heads, T, hd])."""
        t = len(tokens)
        x = self.emb[torch.as_tensor(tokens, dtype=torch.long)]
        pos = np.arange(t)
        mask = torch.full((t, t), float("-inf")).triu(1)
        layers = []
        g = self.n_heads // self.n_kv_heads
        for l in range(self.n_layers):
            h = self._rms(x, self.rms_att[l])
            q = self.rope((h @ self.wq[l].T).view(t, self.n_heads, self.head_dim), pos)
            k = self.rope((h @ self.wk[l].T).view(t, self.n_kv_heads, self.head_dim), pos)
            v = (h @ self.wv[l].T).view(t, self.n_kv_heads, self.head_dim)
            q, k, v = (y.transpose(0, 1).contiguous() for y in (q, k, v))
            layers.append((q, k, v))
            kk, vv = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
            s = q @ kk.transpose(1, 2) / self.head_dim ** 0.5 + mask
            o = (torch.softmax(s, -1) @ vv).transpose(0, 1).reshape(t, self.dim)
            x = self._ffn(x + o @ self.wo[l].T, l)
        return self._rms(x, self.rms_final) @ self.cls.T, layers

    def decode_step(self, token, position, attend):
        """One token at `position`; attend(layer, q [Hq, hd], k [Hkv, hd], v [Hkv, hd]) appends
        k, v to the caller's cache and returns the attention output [Hq, hd]. -> logits [vocab]."""
        x = self.emb[token]
        for l in range(self.n_layers):
            h = self._rms(x, self.rms_att[l])
            q = self.rope((h @ self.wq[l].T).view(1, self.n_heads, self.head_dim), [position])[0]
            k = self.rope((h @ self.wk[l].T).view(1, self.n_kv_heads, self.head_dim),
                          [position])[0]
            v = (h @ self.wv[l].T).view(self.n_kv_heads, self.head_dim)
            o = attend(l, q, k, v).reshape(self.dim)
            x = self._ffn(x + o @ self.wo[l].T, l)
        return self._rms(x, self.rms_final) @ self.cls.T
