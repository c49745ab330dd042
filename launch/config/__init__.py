"""The launcher's configuration: the command-line options and the environment parsed and checked before any
process group exists, so that an invalid one is reported once per node and every rank exits with status 2.

- `job`: one run's `JobConfig` (`job_config`: the options checked, `DTYPES`, the device, the link);
- `decode`: what generation adds, `DecodeConfig` (`decode_config`), its prefill modes (`prefill_modes`) and the
  prefill options it takes or refuses (`check_generation_options`);
- `modes`: the names ``--mode`` / ``--decode-mode`` take, a list of them parsed (`ModeList`, `split_modes`)
  and resolved (`resolve_modes`), decode's candidates and exchanges;
- `environment`: the toolkit's environment variables checked, and those every rank must agree on; the compute
  threads of a rank (`compute_threads`);
- `model`: the job's model settings, the reference's preset or a transformers config, checked against
  what its model can run (`transformers_config`, `check_transformers_model`);
- `dry_run`: ``--dry-run`` and the ranks it sizes the job for (`DryRun`, `dry_run_config`);
- `errors`: `ConfigError`.

Importing it imports no transformers: that is done for ``--model NAME|PATH`` only.
"""
from .errors import ConfigError
from .modes import (ALL_MODES, AUTO, DECODE_AUTO_MODES, DECODE_CALIBRATION_ROUNDS, DECODE_EXCHANGES, DECODE_MODE_NAMES,
                    MODE_NAMES, ModeList, resolve_modes, split_modes)
from .environment import ENV_THREADS, EnvValue, compute_threads, environment
from .model import (OVERRIDE_OPTIONS, REFERENCE, ModelSettings, Overrides, build_model_config, check_transformers_model,
                    check_transformers_overrides, n_experts, transformers_config)
from .job import (DTYPES, MAX_SEED, JobConfig, job_config, parse_cpu_link, parse_seq_lens, resolve_device,
                  vocab_size)
from .decode import (DecodeConfig, captured_path, check_exchange, check_generation_options, decode_config,
                     parse_buckets, prefill_modes)
from .dry_run import DryRun, dry_run_config

__all__ = [
    "ConfigError",
    "ALL_MODES", "AUTO", "DECODE_AUTO_MODES", "DECODE_CALIBRATION_ROUNDS", "DECODE_EXCHANGES", "DECODE_MODE_NAMES",
    "MODE_NAMES", "ModeList", "resolve_modes", "split_modes",
    "ENV_THREADS", "EnvValue", "compute_threads", "environment",
    "OVERRIDE_OPTIONS", "REFERENCE", "ModelSettings", "Overrides", "build_model_config", "check_transformers_model",
    "check_transformers_overrides", "n_experts", "transformers_config",
    "DTYPES", "MAX_SEED", "JobConfig", "job_config", "parse_cpu_link", "parse_seq_lens", "resolve_device", "vocab_size",
    "DecodeConfig", "captured_path", "check_exchange", "check_generation_options", "decode_config", "parse_buckets",
    "prefill_modes",
    "DryRun", "dry_run_config",
]
