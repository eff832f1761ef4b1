"""kvc-pd-proxy: an OpenAI-compatible prefill/decode proxy for vLLM instances running KvcConnector.

    kvc-pd-proxy --prefill http://p:8100 --decode http://d:8200 [--spec keydiff:0.5] \\
                 [--kvcd kvcd:50051] [--port 8000]

Per request (/v1/completions, /v1/chat/completions, streamed or not):
  1. prefill: the request with max_tokens 1, unstreamed, and kv_transfer_params
     {"do_remote_decode": true, "kvc": {"spec": ...}}; the prefill instance stores the prompt's
     cache in kvcd and answers the kv_transfer_params the decode side needs;
  2. decode: the original request plus those params. A lossy cache gets a cache_salt unique to
     it, so vLLM's prefix cache never hands its blocks to other requests. An evicted cache (K of
     S tokens kept) gets a rewritten prompt: K placeholder token ids and the prompt's last token
     (chat: as kv_transfer_params["prompt_token_ids"]), which the decode instance fills with the
     K kept tokens from kvcd.
With an evicted cache the decode instance never sees the real prompt, so options that read the
prompt are refused (HTTP 400 naming the option): repetition_penalty != 1 (vLLM applies it to
prompt and output tokens), echo, prompt_logprobs, truncate_prompt_tokens, beam search. The
usage's prompt_tokens is put back to the real prompt length. presence and frequency penalties
read only generated tokens and stay allowed.

The spec comes from the request's kv_transfer_params {"kvc": {"spec": ...}} or --spec. Errors are
JSON {"error": {"message", "type", "code"}}: 400 bad request, 502 an instance failed, 503 an
instance is unreachable, 504 a timeout. Idle connections to the instances are pooled for
--upstream-keepalive seconds (below vLLM's 5 s), and a request an instance closed unread is sent
once more on a new connection. /health checks every instance (and kvcd with --kvcd);
/metrics serves the proxy's own Prometheus metrics (kvc_proxy_*).
"""

import argparse
import asyncio
import hashlib
import itertools
import json
import logging
import sys
import time

import aiohttp
from aiohttp import web
import prometheus_client as prom

from .spec import SpecError, parse_spec

log = logging.getLogger("kvc.pd_proxy")
# Client headers passed on to the instances (vLLM's --api-key checks Authorization).
FORWARDED = ("authorization", "x-request-id")
PROMPT_OPTIONS = ("repetition_penalty", "echo", "prompt_logprobs", "truncate_prompt_tokens",
                  "use_beam_search")


class ProxyError(Exception):
    def __init__(self, status, message, kind="proxy_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status, message, kind):
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status)


class Metrics:
    def __init__(self):
        r = self.registry = prom.CollectorRegistry()
        self.requests = prom.Counter("kvc_proxy_requests", "Requests by endpoint, cache mode and "
                                     "outcome", ["endpoint", "mode", "outcome"], registry=r)
        self.seconds = prom.Histogram("kvc_proxy_phase_seconds", "Seconds per phase", ["phase"],
                                      registry=r, buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5,
                                                           5, 10, 30, 60, 120, 300))
        self.ttft = prom.Histogram("kvc_proxy_time_to_first_token_seconds", "Proxy arrival to "
                                   "the decode instance's first byte", registry=r,
                                   buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))
        self.stored = prom.Counter("kvc_proxy_stored_bytes", "Bytes kvcd stored for proxied "
                                   "requests", registry=r)
        self.input = prom.Counter("kvc_proxy_cache_input_bytes", "Uncompressed cache bytes of "
                                  "proxied requests", registry=r)
        self.tokens = prom.Counter("kvc_proxy_prompt_tokens", "Prompt tokens stored and kept",
                                   ["kind"], registry=r)
        self.upstream = prom.Counter("kvc_proxy_upstream_errors", "Failed calls to instances",
                                     ["role", "reason"], registry=r)
        self.inflight = prom.Gauge("kvc_proxy_inflight_requests", "Requests in progress",
                                   registry=r)


class Proxy:
    def __init__(self, args):
        self.args = args
        self.prefill = itertools.cycle(args.prefill)
        self.decode = itertools.cycle(args.decode)
        self.metrics = Metrics()
        self.session = None
        self.kvcd = None
        if args.kvcd:
            from ..client import Client
            opts = {"timeout": args.kvcd_timeout, "max_attempts": 1}
            if args.kvcd_token_file:
                with open(args.kvcd_token_file) as f:
                    opts["token"] = f.read().strip()
            if args.kvcd_ca_file:
                opts.update(tls=True, ca_file=args.kvcd_ca_file)
            if args.kvcd_server_name:
                opts["server_name_override"] = args.kvcd_server_name
            self.kvcd = Client(args.kvcd, **opts)
        self.default_spec = parse_spec(args.spec, have_query_stats=True)

    async def start(self, app):
        timeout = aiohttp.ClientTimeout(total=None, connect=self.args.connect_timeout)
        # Idle connections to the instances are dropped after --upstream-keepalive seconds,
        # before the servers drop them (vLLM's HTTP server closes them after 5 s): a request
        # sent on a connection the server is closing fails with "Server disconnected".
        keep = self.args.upstream_keepalive
        connector = aiohttp.TCPConnector(limit=self.args.upstream_connections,
                                         **({"keepalive_timeout": keep} if keep > 0 else
                                            {"force_close": True}))
        self.session = aiohttp.ClientSession(timeout=timeout, connector=connector)

    async def stop(self, app):
        await self.session.close()
        if self.kvcd is not None:
            self.kvcd.close()

    # ---- upstream calls ---------------------------------------------------------------------

    async def _post(self, role, url, body, timeout, headers):
        """POST to an instance; once more on a new connection when it closed the connection
        before any answer. That is a pooled keep-alive connection the server timed out as the
        request went out: the server never read it. A retried prefill stores the cache again under
        a new id; loading a stored cache does not consume it."""
        for attempt in (1, 2):
            try:
                return await self.session.post(url, json=body, headers=headers, timeout=timeout)
            except aiohttp.ServerDisconnectedError:
                if attempt == 2:
                    raise
                self.metrics.upstream.labels(role, "disconnected_retried").inc()
                log.info("%s instance %s closed the connection before answering; retrying "
                         "once on a new connection", role, url)

    async def _post_json(self, role, url, body, timeout, headers=None):
        try:
            async with await self._post(role, url, body, aiohttp.ClientTimeout(
                    total=timeout, connect=self.args.connect_timeout), headers) as r:
                text = await r.text()
                try:
                    data = json.loads(text)
                except ValueError:
                    data = None
                if r.status != 200 or not isinstance(data, dict):
                    self.metrics.upstream.labels(role, f"http_{r.status}").inc()
                    msg = data.get("error", {}).get("message") if isinstance(data, dict) and \
                        isinstance(data.get("error"), dict) else text[:500]
                    status = 400 if r.status == 400 else 502
                    raise ProxyError(status, f"{role} instance {url}: HTTP {r.status}: {msg}",
                                     "upstream_error")
                return data
        except asyncio.TimeoutError:
            self.metrics.upstream.labels(role, "timeout").inc()
            raise ProxyError(504, f"{role} instance {url}: no answer within {timeout:g} s",
                             "timeout")
        except aiohttp.ClientError as e:
            self.metrics.upstream.labels(role, "unreachable").inc()
            raise ProxyError(503, f"{role} instance {url}: unreachable: {e}", "unavailable")

    def _spec_of(self, body):
        kv = body.get("kv_transfer_params")
        if kv is not None and not isinstance(kv, dict):
            raise ProxyError(400, "kv_transfer_params: expected an object", "invalid_request")
        kvc = (kv or {}).get("kvc", {})
        if not isinstance(kvc, dict):
            raise ProxyError(400, "kv_transfer_params.kvc: expected an object",
                             "invalid_request")
        if "spec" not in kvc:
            return self.args.spec, self.default_spec
        try:
            return kvc["spec"], parse_spec(kvc["spec"], have_query_stats=True)
        except SpecError as e:
            raise ProxyError(400, str(e), "invalid_request")

    @staticmethod
    def _prompt_options(body):
        out = []
        for key in PROMPT_OPTIONS:
            v = body.get(key)
            if key == "repetition_penalty":
                if v not in (None, 1, 1.0):
                    out.append(key)
            elif v not in (None, False, 0):
                out.append(key)
        return out

    async def handle(self, request):
        endpoint = request.path
        t0 = time.monotonic()
        self.metrics.inflight.inc()
        mode = "none"
        try:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError):
                raise ProxyError(400, "the request body is not JSON", "invalid_request")
            if not isinstance(body, dict):
                raise ProxyError(400, "the request body is not a JSON object", "invalid_request")
            spec_value, spec = self._spec_of(body)
            refused = self._prompt_options(body)
            if spec.evicts and refused:
                raise ProxyError(400, f"{', '.join(refused)}: read the prompt, but with the "
                                 f"evicting spec '{spec.text}' the decode instance sees "
                                 f"placeholder tokens instead; drop the option or use a "
                                 f"full-length spec", "invalid_request")
            pre = dict(body)
            for key in ("stream", "stream_options", "logprobs", "top_logprobs", "n",
                        "min_tokens", "max_completion_tokens", "use_beam_search"):
                pre.pop(key, None)
            pre.update(max_tokens=1, stream=False,
                       kv_transfer_params={"do_remote_decode": True, "kvc": {"spec": spec_value}})
            prefill_url = next(self.prefill) + endpoint
            t_pre = time.monotonic()
            fwd = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
            answer = await self._post_json("prefill", prefill_url, pre, self.args.prefill_timeout,
                                           fwd)
            self.metrics.seconds.labels("prefill").observe(time.monotonic() - t_pre)
            params = answer.get("kv_transfer_params")
            if not isinstance(params, dict) or not isinstance(params.get("kvc"), dict):
                raise ProxyError(502, f"prefill instance {prefill_url} answered without kvc "
                                 f"kv_transfer_params: is it running KvcConnector with kv_role "
                                 f"kv_producer or kv_both?", "upstream_error")
            kvc = params["kvc"]
            asked = (body.get("kv_transfer_params") or {}).get("kvc", {})
            if asked.get("load") in ("async", "sync"):
                kvc = params["kvc"] = dict(kvc, load=asked["load"])
            dec = dict(body)
            dec["kv_transfer_params"] = params
            headers = {"x-kvc-seq-len": str(kvc.get("seq_len", 0))}
            prompt_tokens = None
            if kvc.get("error"):
                mode = "error"
                headers["x-kvc-error"] = str(kvc["error"])[:200]
                log.warning("prefill stored no cache: %s", kvc["error"])
            else:
                mode = kvc.get("mode", "full")
                headers.update({"x-kvc-cache-id": kvc.get("cache_id", ""), "x-kvc-mode": mode,
                                "x-kvc-kept-tokens": str(kvc.get("kept_tokens", 0)),
                                "x-kvc-stored-bytes": str(kvc.get("stored_bytes", 0)),
                                "x-kvc-input-bytes": str(kvc.get("input_bytes", 0))})
                self.metrics.stored.inc(kvc.get("stored_bytes", 0))
                self.metrics.input.inc(kvc.get("input_bytes", 0))
                self.metrics.tokens.labels("stored").inc(kvc.get("seq_len", 0))
                self.metrics.tokens.labels("kept").inc(kvc.get("kept_tokens", 0))
                if kvc.get("spec", "none") != "none":
                    dec["cache_salt"] = cache_salt(kvc["cache_id"], body.get("cache_salt"))
                if mode == "evicted":
                    if refused:  # a spec that kept all tokens but evicted here: cannot happen
                        raise ProxyError(400, f"{', '.join(refused)}: read the prompt",
                                         "invalid_request")
                    k = int(kvc["kept_tokens"])
                    ids = [self.args.placeholder_token] * k + [int(kvc["last_token"])]
                    params = dict(params)
                    params["kvc"] = dict(kvc, placeholder=self.args.placeholder_token)
                    dec["kv_transfer_params"] = params
                    if endpoint.endswith("/chat/completions"):
                        params["prompt_token_ids"] = ids
                    else:
                        dec["prompt"] = ids
                    prompt_tokens = int(kvc["seq_len"]) + 1
            decode_url = next(self.decode) + endpoint
            if body.get("stream"):
                resp = await self._stream_decode(request, decode_url, dec, headers,
                                                 prompt_tokens, t0, fwd)
            else:
                t_dec = time.monotonic()
                out = await self._post_json("decode", decode_url, dec, self.args.timeout, fwd)
                self.metrics.seconds.labels("decode").observe(time.monotonic() - t_dec)
                self.metrics.ttft.observe(time.monotonic() - t0)
                dparams = out.pop("kv_transfer_params", None)
                if isinstance(dparams, dict) and isinstance(dparams.get("kvc_decode"), dict):
                    d = dparams["kvc_decode"]
                    headers["x-kvc-fetched-bytes"] = str(d.get("fetched_bytes", 0))
                    headers["x-kvc-loaded-tokens"] = str(d.get("loaded_tokens", 0))
                if prompt_tokens is not None and isinstance(out.get("usage"), dict):
                    _fix_usage(out["usage"], prompt_tokens)
                resp = web.json_response(out, headers=headers)
            self.metrics.requests.labels(endpoint, mode, "ok").inc()
            self.metrics.seconds.labels("total").observe(time.monotonic() - t0)
            return resp
        except ProxyError as e:
            self.metrics.requests.labels(endpoint, mode, f"http_{e.status}").inc()
            message = e.message
            if e.status in (502, 503) and "decode instance" in message and self.kvcd:
                message += self._kvcd_note()
            log.warning("%s: %s", endpoint, message)
            return error_response(e.status, message, e.kind)
        finally:
            self.metrics.inflight.dec()

    def _kvcd_note(self):
        try:
            self.kvcd.server_info()
            return " (kvcd answers; see the decode instance's log for the load error)"
        except Exception as e:
            return f" (kvcd {self.args.kvcd}: {e})"

    async def _stream_decode(self, request, url, body, headers, prompt_tokens, t0, fwd):
        timeout = aiohttp.ClientTimeout(total=self.args.timeout,
                                        connect=self.args.connect_timeout)
        try:
            async with await self._post("decode", url, body, timeout, fwd) as r:
                if r.status != 200:
                    text = await r.text()
                    self.metrics.upstream.labels("decode", f"http_{r.status}").inc()
                    raise ProxyError(400 if r.status == 400 else 502,
                                     f"decode instance {url}: HTTP {r.status}: {text[:500]}",
                                     "upstream_error")
                resp = web.StreamResponse(headers={**headers, "Content-Type":
                                                   "text/event-stream"})
                await resp.prepare(request)
                first = True
                buf = b""
                async for chunk in r.content.iter_any():
                    if first:
                        self.metrics.ttft.observe(time.monotonic() - t0)
                        first = False
                    if prompt_tokens is None:
                        await resp.write(chunk)
                        continue
                    buf += chunk
                    *events, buf = buf.split(b"\n\n")
                    for ev in events:
                        await resp.write(_fix_event(ev, prompt_tokens) + b"\n\n")
                if buf:
                    await resp.write(buf if prompt_tokens is None else
                                     _fix_event(buf, prompt_tokens))
                await resp.write_eof()
                return resp
        except asyncio.TimeoutError:
            self.metrics.upstream.labels("decode", "timeout").inc()
            raise ProxyError(504, f"decode instance {url}: no complete answer within "
                             f"{self.args.timeout:g} s", "timeout")
        except aiohttp.ClientError as e:
            self.metrics.upstream.labels("decode", "unreachable").inc()
            raise ProxyError(503, f"decode instance {url}: unreachable: {e}", "unavailable")

    # ---- other endpoints --------------------------------------------------------------------

    async def health(self, request):
        checks = {}

        async def probe(role, base):
            try:
                async with self.session.get(base + "/health", timeout=aiohttp.ClientTimeout(
                        total=self.args.health_timeout)) as r:
                    checks[f"{role} {base}"] = "ok" if r.status == 200 else f"HTTP {r.status}"
            except Exception as e:
                checks[f"{role} {base}"] = f"unreachable: {type(e).__name__} {e}".strip()
        await asyncio.gather(*(probe("prefill", u) for u in self.args.prefill),
                             *(probe("decode", u) for u in self.args.decode))
        if self.kvcd is not None:
            try:
                info = await asyncio.get_running_loop().run_in_executor(None,
                                                                        self.kvcd.server_info)
                checks[f"kvcd {self.args.kvcd}"] = "ok" if info.serving else "draining"
            except Exception as e:
                checks[f"kvcd {self.args.kvcd}"] = str(e)
        ok = all(v == "ok" for v in checks.values())
        return web.json_response({"status": "ok" if ok else "unhealthy", "checks": checks},
                                 status=200 if ok else 503)

    async def models(self, request):
        base = self.args.decode[0]
        try:
            async with self.session.get(base + "/v1/models", timeout=aiohttp.ClientTimeout(
                    total=self.args.health_timeout)) as r:
                return web.json_response(await r.json(), status=r.status)
        except Exception as e:
            return error_response(503, f"decode instance {base}: {e}", "unavailable")

    async def prom_metrics(self, request):
        return web.Response(body=prom.generate_latest(self.metrics.registry),
                            headers={"Content-Type": prom.CONTENT_TYPE_LATEST})


def cache_salt(cache_id, user_salt=None):
    """A cache_salt unique to one stored cache (vLLM takes at most 128 characters, no '/'),
    folding in the client's own salt."""
    h = hashlib.sha256(f"{user_salt or ''}|{cache_id}".encode()).hexdigest()
    return "kvc-" + h[:48]


def _fix_usage(usage, prompt_tokens):
    placeholder = usage.get("prompt_tokens")
    usage["prompt_tokens"] = prompt_tokens
    if isinstance(usage.get("total_tokens"), int) and isinstance(placeholder, int):
        usage["total_tokens"] += prompt_tokens - placeholder


def _fix_event(ev, prompt_tokens):
    if not ev.startswith(b"data: ") or ev.strip() == b"data: [DONE]" or b'"usage"' not in ev:
        return ev
    try:
        data = json.loads(ev[6:])
    except ValueError:
        return ev
    if isinstance(data, dict) and isinstance(data.get("usage"), dict):
        _fix_usage(data["usage"], prompt_tokens)
        return b"data: " + json.dumps(data).encode()
    return ev


def make_app(args):
    proxy = Proxy(args)
    app = web.Application(client_max_size=args.max_body_bytes)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.handle)
    app.router.add_post("/v1/chat/completions", proxy.handle)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/metrics", proxy.prom_metrics)
    app["proxy"] = proxy
    return app


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="kvc-pd-proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="append", required=True,
                    help="prefill instance base URL (repeat for several; round robin)")
    ap.add_argument("--decode", action="append", required=True,
                    help="decode instance base URL (repeat for several; round robin)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--spec", default="none", help="default compression spec (kvc spec string)")
    ap.add_argument("--placeholder-token", type=int, default=0,
                    help="token id of the placeholders of an evicted cache's decode request")
    ap.add_argument("--timeout", type=float, default=600, help="seconds for a decode answer")
    ap.add_argument("--prefill-timeout", type=float, default=300)
    ap.add_argument("--connect-timeout", type=float, default=5)
    ap.add_argument("--health-timeout", type=float, default=5)
    ap.add_argument("--upstream-keepalive", type=float, default=2,
                    help="seconds an idle connection to an instance is kept for reuse; below "
                         "the instances' own keep-alive (vLLM: 5 s); 0: a new connection per "
                         "request")
    ap.add_argument("--upstream-connections", type=int, default=256,
                    help="most connections open to the instances at once")
    ap.add_argument("--max-body-bytes", type=int, default=64 << 20)
    ap.add_argument("--kvcd", default="", help="kvcd target, for /health and error messages")
    ap.add_argument("--kvcd-token-file", default="")
    ap.add_argument("--kvcd-ca-file", default="", help="CA bundle: TLS to kvcd")
    ap.add_argument("--kvcd-server-name", default="")
    ap.add_argument("--kvcd-timeout", type=float, default=3)
    args = ap.parse_args(argv)
    for name in ("timeout", "prefill_timeout", "connect_timeout", "health_timeout"):
        if not 0 < getattr(args, name) <= 86400:
            ap.error(f"--{name.replace('_', '-')}: must be in (0, 86400]")
    if not 0 <= args.upstream_keepalive <= 3600:
        ap.error("--upstream-keepalive: must be in [0, 3600]")
    if not 1 <= args.upstream_connections <= 65536:
        ap.error("--upstream-connections: must be in [1, 65536]")
    if args.placeholder_token < 0:
        ap.error("--placeholder-token: must be >= 0")
    args.prefill = [u.rstrip("/") for u in args.prefill]
    args.decode = [u.rstrip("/") for u in args.decode]
    try:
        parse_spec(args.spec, have_query_stats=True)
    except SpecError as e:
        ap.error(f"--spec: {e}")
    return args


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    web.run_app(make_app(args), host=args.host, port=args.port, print=None,
                access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
