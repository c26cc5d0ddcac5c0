"""The JSON schema of the harness's result files, and a validator for it (no dependency).

``SCHEMA`` is a JSON Schema (draft 2020-12) document: ``python -m bench --print-schema`` prints
it for other tools. :func:`validate` checks a document against it, implementing the subset of
JSON Schema the schema uses (type, properties, required, additionalProperties, items, enum,
minimum, minItems, $ref to $defs).

A results file holds:

* ``schema_version`` (1) and ``complete`` (false while a run is still writing it suite by suite);
* ``env``: where and with what it was measured (date, command line, git commit and dirty flag,
  CPU/GPU mode, GPU name, driver, CUDA, torch, triton and tritonmoe versions, ...);
* ``config``: the run's options (suites, presets, tokens, routings, dtype, backends,
  baselines, reps, warm-up, L2 flush, seed);
* ``roofs``: the roofs measured at the start (``matmul_<dtype>`` in TFLOP/s, ``copy`` in bytes/s
  counting reads and writes);
* ``results``: one row per benchmark and implementation (see ``$defs.result``): its status
  ("ok", "unavailable" with the reason in ``note``, or "error"), timing statistics in seconds
  (median, p20, p80, min, max, mean over ``reps``) and the raw times, the useful FLOPs and
  minimum bytes of one call and the TFLOP/s and GB/s they give, the fraction of the roofline
  (``roof_frac``, ``roof_bound``), speedups over the baselines measured with it (``speedup``:
  baseline impl -> baseline median / this median), peak memory and the analytic minimum with
  their ratio, NVML telemetry (mean/max of GPU utilization %, memory used bytes, power W, SM
  clock MHz), and suite-specific ``extra`` figures;
* ``notes`` (lines the run printed about itself) and ``wall_time_s``;
* optionally ``check`` (written by ``python -m bench check``, see :mod:`bench.check`): the commit
  measured, the gpu-marked tests' outcome, each section's estimated and measured wall time,
  one record per target (``$defs.target``: value, goal, met or not), and ``stability`` (the
  sentinel's medians at the start, middle and end, its drift, and whether the run is unstable).

Rows measured in interleaved rounds (``python -m bench check``, :mod:`bench.rounds`) add, each
optional so older files still validate: ``timing`` (mode ``graph`` / ``graph-flush`` / ``eager``
/ ``cpu``, the fallback's reason, calls per replay, rounds, device-time and eager-time statistics,
p80/p20 spread and the noisy flag), ``clocks`` (per-rep SM MHz and throttle reasons),
``per_clock_eff`` and ``roof_frac_q`` (median, p20, p80 of per-rep values), ``roof_fracs``
(the same per roof: ``matmul`` and ``copy``, which the targets read), ``peers`` (per-round
ratio of every other implementation's time to this row's), ``best_peer`` (that ratio for the
fastest peer, torch._grouped_mm or Liger, of the same rounds) and ``config``.
"""

from __future__ import annotations

SCHEMA_VERSION = 1

_num = {"type": "number"}
_num_or_null = {"type": ["number", "null"]}
_int_or_null = {"type": ["integer", "null"]}
_str_or_null = {"type": ["string", "null"]}
_str_list = {"type": "array", "items": {"type": "string"}}
_mean_max = {
    "type": ["object", "null"],
    "required": ["mean", "max"],
    "properties": {"mean": _num, "max": _num},
    "additionalProperties": False,
}

SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://github.com/tritonmoe/tritonmoe/bench/results.schema.json",
    "title": "tritonmoe benchmark results",
    "type": "object",
    "required": ["schema_version", "complete", "env", "config", "roofs", "results", "notes", "wall_time_s"],
    "additionalProperties": False,
    "properties": {
        "schema_version": {"type": "integer", "enum": [SCHEMA_VERSION]},
        "complete": {"type": "boolean"},
        "env": {
            "type": "object",
            "required": [
                "date_utc", "command", "git_commit", "git_dirty", "mode", "device", "gpu_name", "driver",
                "cuda", "torch", "triton", "tritonmoe", "python",
            ],
            "properties": {
                "date_utc": {"type": "string"},
                "command": {"type": "string"},
                "git_commit": _str_or_null,
                "git_dirty": {"type": ["boolean", "null"]},
                "mode": {"type": "string", "enum": ["cpu", "gpu"]},
                "device": {"type": "string"},
                "gpu_name": _str_or_null,
                "gpu_count": {"type": "integer", "minimum": 0},
                "gpu_capability": _str_or_null,
                "gpu_memory_bytes": _int_or_null,
                "driver": _str_or_null,
                "cuda": _str_or_null,
                "torch": {"type": "string"},
                "triton": _str_or_null,
                "tritonmoe": _str_or_null,
                "python": {"type": "string"},
                "platform": {"type": "string"},
                "cpu_count": _int_or_null,
                "torch_threads": {"type": "integer"},
            },
            "additionalProperties": True,
        },
        "config": {
            "type": "object",
            "required": [
                "suites", "presets", "tokens", "routings", "dtype", "backends", "baselines", "reps", "warmup",
                "l2_flush", "seed",
            ],
            "properties": {
                "suites": _str_list,
                "presets": _str_list,
                "tokens": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}},
                "routings": {"type": ["array", "null"], "items": {"type": "string"}},
                "dtype": {"type": "string"},
                "backends": _str_list,
                "baselines": _str_list,
                "reps": {"type": "integer", "minimum": 1},
                "warmup": {"type": "integer", "minimum": 0},
                "l2_flush": {"type": "boolean"},
                "seed": {"type": "integer"},
            },
            "additionalProperties": True,
        },
        "roofs": {"type": "object", "additionalProperties": {"$ref": "#/$defs/roof"}},
        "results": {"type": "array", "items": {"$ref": "#/$defs/result"}},
        "notes": _str_list,
        "wall_time_s": {"type": "number", "minimum": 0},
        "check": {
            "type": "object",
            "required": ["commit", "tests", "sections", "targets", "summary"],
            "properties": {
                "commit": _str_or_null,
                "dirty": {"type": ["boolean", "null"]},
                "tests": {
                    "type": "object",
                    "required": ["status", "summary", "wall_s"],
                    "properties": {
                        "status": {"type": "string", "enum": ["passed", "failed", "timed out", "not run", "skipped"]},
                        "summary": {"type": "string"},
                        "wall_s": {"type": "number", "minimum": 0},
                        # bench.gpu_tests: tests per status, shards run, each test that did not
                        # pass, the summary files
                        "counts": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
                        "shards": {"type": "integer", "minimum": 0},
                        "failing": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["id", "status", "shard"],
                                "properties": {"id": {"type": "string"}, "status": {"type": "string"},
                                               "shard": {"type": "string"}, "message": {"type": "string"}},
                            },
                        },
                        "files": _str_list,
                    },
                },
                "sections": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "status", "estimate_s", "wall_s", "entries"],
                        "properties": {
                            "name": {"type": "string"},
                            "status": {"type": "string", "enum": ["ran", "skipped"]},
                            "estimate_s": {"type": "number", "minimum": 0},
                            "wall_s": {"type": "number", "minimum": 0},
                            "entries": {"type": "integer", "minimum": 0},
                        },
                    },
                },
                "targets": {"type": "array", "items": {"$ref": "#/$defs/target"}},
                "summary": {"type": "object", "additionalProperties": {"type": "integer"}},
                # bench.stability: the sentinel re-measured at the start, middle and end
                "stability": {
                    "type": "object",
                    "required": ["sentinel", "points", "drift", "limit", "unstable"],
                    "properties": {
                        "sentinel": {"type": "string"},
                        "points": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["at"],
                                "properties": {"at": {"type": "string"}, "median_s": _num, "p20_s": _num,
                                               "p80_s": _num, "mhz": _num_or_null, "rounds": {"type": "integer"},
                                               "error": {"type": "string"}},
                                "additionalProperties": False,
                            },
                        },
                        "drift": _num_or_null,
                        "limit": _num,
                        "unstable": {"type": "boolean"},
                    },
                    "additionalProperties": False,
                },
            },
            "additionalProperties": False,
        },
    },
    "$defs": {
        "target": {
            "type": "object",
            "required": ["name", "metric", "op", "goal", "value", "status", "row", "note"],
            "properties": {
                "name": {"type": "string"},
                "metric": {"type": "string", "enum": ["time_us", "eager_us", "eager_ratio", "mm_roof", "mem_roof",
                                                      "x_torch", "x_gmm", "x_liger"]},
                "op": {"type": "string", "enum": ["<=", ">="]},
                "goal": _num,
                "value": _num_or_null,
                "status": {"type": "string", "enum": ["met", "not met", "not measured", "skipped"]},
                "row": _str_or_null,
                "per_clock": _num_or_null,
                "note": _str_or_null,
            },
            "additionalProperties": False,
        },
        "qstats": {
            "type": "object",
            "required": ["median", "p20", "p80", "min", "max"],
            "properties": {"median": _num, "p20": _num, "p80": _num, "min": _num, "max": _num},
            "additionalProperties": False,
        },
        "timing": {
            "type": "object",
            "required": ["mode", "note", "calls_per_replay", "cold_l2", "rounds", "device_s", "eager_s", "spread",
                         "noisy"],
            "properties": {
                "mode": {"type": "string", "enum": ["graph", "graph-flush", "eager", "cpu"]},
                "note": _str_or_null,
                "calls_per_replay": {"type": "integer", "minimum": 1},
                "cold_l2": {"type": "boolean"},
                "rounds": {"type": "integer", "minimum": 0},
                "warmup_s": _num,
                "estimate_s": _num,
                "device_s": {"$ref": "#/$defs/stats"},
                "eager_s": {"type": ["object", "null"], "$ref": "#/$defs/stats"},
                "spread": _num,
                "noisy": {"type": "boolean"},
            },
            "additionalProperties": False,
        },
        "clocks": {
            "type": ["object", "null"],
            "required": ["sm_mhz", "median", "min", "max", "throttle"],
            "properties": {
                "sm_mhz": {"type": "array", "items": _num_or_null},
                "median": _num, "min": _num, "max": _num,
                "throttle": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
            },
            "additionalProperties": False,
        },
        "stats": {
            "type": "object",
            "required": ["median", "p20", "p80", "min", "max", "mean", "reps"],
            "properties": {
                "median": _num, "p20": _num, "p80": _num, "min": _num, "max": _num, "mean": _num,
                "reps": {"type": "integer", "minimum": 1},
            },
            "additionalProperties": False,
        },
        "roof": {
            "type": "object",
            "required": ["kind", "what", "dtype", "time_s", "tflops", "gbps"],
            "properties": {
                "kind": {"type": "string", "enum": ["matmul", "copy"]},
                "what": {"type": "string"},
                "dtype": {"type": "string"},
                "time_s": {"$ref": "#/$defs/stats"},
                "tflops": _num_or_null,
                "gbps": _num_or_null,
                "n": {"type": "integer"},
                "nbytes": {"type": "integer"},
            },
            "additionalProperties": False,
        },
        "result": {
            "type": "object",
            "required": [
                "suite", "name", "case", "mode", "impl", "status", "note", "params", "time_s", "times_s", "flops",
                "bytes", "tflops", "gbps", "roof_frac", "roof_bound", "speedup", "memory", "telemetry", "extra",
            ],
            "properties": {
                "suite": {"type": "string", "enum": ["route", "permute", "ffn", "gemm", "fp8", "layer", "ep", "plan", "lina", "parm", "inference", "memory"]},
                "name": {"type": "string"},
                "case": {"type": "string"},
                "mode": {"type": "string"},
                "impl": {"type": "string"},
                "status": {"type": "string", "enum": ["ok", "unavailable", "error"]},
                "note": _str_or_null,
                "params": {"type": "object"},
                "time_s": {"type": ["object", "null"], "$ref": "#/$defs/stats"},
                "times_s": {"type": "array", "items": {"type": "number", "minimum": 0}},
                "flops": _num_or_null,
                "bytes": _num_or_null,
                "tflops": _num_or_null,
                "gbps": _num_or_null,
                "roof_frac": _num_or_null,
                "roof_bound": {"type": ["string", "null"], "enum": ["compute", "memory", None]},
                "speedup": {"type": "object", "additionalProperties": _num},
                "memory": {
                    "type": "object",
                    "required": ["peak_bytes", "peak_extra_bytes", "analytic_min_bytes", "ratio"],
                    "properties": {
                        "peak_bytes": _int_or_null,
                        "peak_extra_bytes": _int_or_null,
                        "analytic_min_bytes": _int_or_null,
                        "ratio": _num_or_null,
                    },
                    "additionalProperties": False,
                },
                "telemetry": {
                    "type": ["object", "null"],
                    "required": ["samples"],
                    "properties": {
                        "samples": {"type": "integer", "minimum": 0},
                        "gpu_util_pct": _mean_max,
                        "mem_used_bytes": _mean_max,
                        "power_w": _mean_max,
                        "sm_clock_mhz": _mean_max,
                    },
                    "additionalProperties": False,
                },
                "extra": {"type": "object"},
                # interleaved rounds (python -m bench check, bench.rounds): how the times were
                # taken, per-rep SM clocks, per-clock efficiency, the roof fraction's p20-p80, the
                # per-round ratios to every other implementation of the same rounds (peers), and
                # the kernel configuration that ran (filled by the tuned-table work)
                "timing": {"$ref": "#/$defs/timing"},
                "clocks": {"$ref": "#/$defs/clocks"},
                "per_clock_eff": {"type": ["object", "null"], "$ref": "#/$defs/qstats"},
                "roof_frac_q": {"type": ["object", "null"], "$ref": "#/$defs/qstats"},
                "roof_fracs": {"type": "object", "additionalProperties": {"$ref": "#/$defs/qstats"}},
                "peers": {"type": "object", "additionalProperties": {"$ref": "#/$defs/qstats"}},
                "best_peer": {
                    "type": "object",
                    "required": ["impl", "median", "p20", "p80", "min", "max"],
                    "properties": {"impl": {"type": "string"}, "median": _num, "p20": _num, "p80": _num,
                                   "min": _num, "max": _num},
                    "additionalProperties": False,
                },
                "config": {"type": ["object", "string", "null"]},
            },
            "additionalProperties": False,
        },
    },
}


class SchemaError(ValueError):
    """A document that does not match the schema; the message names the JSON path."""


_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "null": lambda v: v is None,
}


def _resolve(ref: str, root: dict) -> dict:
    if not ref.startswith("#/"):
        raise SchemaError(f"unsupported $ref {ref!r}")
    node = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def _check(value, sch: dict, root: dict, path: str) -> None:
    types = sch.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_TYPES[t](value) for t in types):
            raise SchemaError(f"{path}: expected {' or '.join(types)}, got {type(value).__name__} {value!r:.60}")
        if value is None:  # null allowed by type: nothing more to check
            return
    if "$ref" in sch:
        _check(value, _resolve(sch["$ref"], root), root, path)
    if "enum" in sch and value not in sch["enum"]:
        raise SchemaError(f"{path}: {value!r} is not one of {sch['enum']}")
    if "minimum" in sch and isinstance(value, (int, float)) and value < sch["minimum"]:
        raise SchemaError(f"{path}: {value} is below the minimum {sch['minimum']}")
    if isinstance(value, dict):
        for key in sch.get("required", []):
            if key not in value:
                raise SchemaError(f"{path}: missing required field {key!r}")
        props = sch.get("properties", {})
        extra = sch.get("additionalProperties", True)
        for key, v in value.items():
            if key in props:
                _check(v, props[key], root, f"{path}.{key}")
            elif extra is False:
                raise SchemaError(f"{path}: unexpected field {key!r}")
            elif isinstance(extra, dict):
                _check(v, extra, root, f"{path}.{key}")
    if isinstance(value, list):
        if len(value) < sch.get("minItems", 0):
            raise SchemaError(f"{path}: fewer than {sch['minItems']} items")
        if "items" in sch:
            for i, v in enumerate(value):
                _check(v, sch["items"], root, f"{path}[{i}]")


def validate(doc, schema: dict = SCHEMA) -> None:
    """Raise :class:`SchemaError` (naming the offending path) unless ``doc`` matches."""
    _check(doc, schema, schema, "$")
