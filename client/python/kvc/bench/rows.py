"""The rows of the side-by-side table: what each compresses and how.

    full                        the uncompressed cache
    kvpress:NAME@R              a kvpress press (presses.PRESSES; KVzipPress and its variants:
                                presses.RECON_PRESSES) at keep ratio R
    kvc:SPEC                    a kvc spec through kvcd (kvcrows); `{r}` in a template is the
                                keep ratio; `|w=N` sets its observation window; `|rows=context`
                                sends a kvzip row only the last S reconstruction queries;
                                `|passes=1` names a kvzip row's reconstruction passes in its
                                spec (each pass's rows normalised over the sinks and its chunk)
    proto:NAME:R[,k=v]          a Python prototype (reference.PROTOTYPES) at keep ratio R

Templates with `{r}` are expanded over the ratios; kvc rows without `{r}` are fixed-size rows
(the "equal bytes" rows: quantization and ThinK on top of eviction).
"""

from dataclasses import dataclass

KVPRESS_DEFAULT = ["streaming", "knorm", "snapkv", "keydiff", "expected", "tova",
                   "adakv-snapkv", "adakv-expected", "criticalkv-snapkv", "snapkv+think0.5",
                   "kvzip", "kvzip-layer"]

# kvpress-matched specs first (parity: same window 64, pooling, statistics), then kvc's own.
KVC_DEFAULT = [
    "streaming:{r}",
    "knorm:{r}",
    "keydiff:{r}",
    "snapkv:{r},kernel=5,pool=avg",
    "snapkv:{r}",
    "expected:{r},stats=1,horizon=512,veps=0",
    "expected:{r},stats=1",
    "h2o:{r}",
    "snapkv:{r},ada=0.2",
    "snapkv:{r},kernel=5,pool=avg+think:0.5",
    "kvzip:{r},ada=0,stats=1",
    "kvzip:{r},ada=0,stats=1,xlayer=1",
    "kvzip:{r},ada=0.2,stats=1,xlayer=1",
]

# At most the bytes of kvpress's keep-0.25 fp16 cache (measured by kvcd on every run).
KVC_BYTES_DEFAULT = [
    "snapkv:0.6+q4g64",
    "snapkv:0.9+q2g64",
    "snapkv:0.75+think:0.5+q4g64",
    "expected:0.6,stats=1+q4g64",
    "kvzip:0.6,ada=0.2,stats=1,xlayer=1+q4g64",
    "kvzip:0.55,ada=0,stats=1,xlayer=1+q4g32",
    "kvzip:0.25,ada=0.2,stats=1,xlayer=1+q4g64",
]

PROTO_DEFAULT = []


@dataclass
class Row:
    name: str     # label in the CSV and the table
    family: str   # full | kvpress | kvc | kvc-bytes | proto
    method: str   # the row without its ratio (for the plot's series)
    keep: object  # the keep ratio, or "" for fixed-size rows
    spec: str     # press name, kvc spec (with options) or prototype spec

    def nominal_stored(self):
        """Bytes over the fp16 full cache, as the method defines them (kvc rows are measured)."""
        if self.family == "full":
            return 1.0
        if self.family in ("kvpress", "proto"):
            k = float(self.keep)
            return k * (0.75 if "think0.5" in self.spec or "+think:0.5" in self.spec else 1.0)
        return float("nan")


def expand(kvpress, kvc, kvc_bytes, proto, ratios):
    rows = [Row("full", "full", "full", 1.0, "full")]
    for r in ratios:
        rows += [Row(f"kvpress:{n}@{r:g}", "kvpress", n, r, n) for n in kvpress]
    for r in ratios:
        for t in kvc:
            spec = t.replace("{r}", f"{r:g}")
            rows.append(Row(f"kvc:{spec}", "kvc", t.replace("{r}", "R"), r, spec))
    rows += [Row(f"kvc:{s}", "kvc-bytes", s, "", s) for s in kvc_bytes]
    for r in ratios:
        for t in proto:
            spec = t.replace("{r}", f"{r:g}")
            rows.append(Row(f"proto:{spec}", "proto", t.replace("{r}", "R"), r, spec))
    return rows


def split_list(text):
    return [x.strip() for x in text.split(";") if x.strip()] if text else []
