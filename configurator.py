"""
Command-line overrides for the plain config block at the top of each script (the nanoGPT way):

    python train_ar.py --epochs=4 --attentions=softmax,hedgehog --device=cpu

Each --key=value must name an existing setting; the value is parsed to that setting's type.
Unknown keys and values of the wrong type are rejected with a message listing what is valid.
pick_device() resolves the scripts' device = "auto"; pyplot() imports matplotlib only when it is there.
"""
import sys

import torch


def configure(config, argv=None):
    """Apply --key=value overrides from argv (default sys.argv[1:]) to the dict `config` in place."""
    argv = sys.argv[1:] if argv is None else argv
    for arg in argv:
        if arg in ("-h", "--help"):
            print("settings (override with --key=value):")
            for key, value in config.items():
                print(f"  --{key}={value}")
            sys.exit(0)
        if not arg.startswith("--") or "=" not in arg:
            sys.exit(f"error: expected --key=value, got {arg!r} (--help lists the settings)")
        key, value = arg[2:].split("=", 1)
        if key not in config:
            sys.exit(f"error: unknown setting {key!r}; valid: {', '.join(config)}")
        old = config[key]
        try:
            if isinstance(old, bool):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                new = value.lower() in ("true", "1")
            else:
                new = type(old)(value)
        except ValueError:
            sys.exit(f"error: --{key} expects a {type(old).__name__}, got {value!r}")
        config[key] = new
    return config


def pick_device(name="auto"):
    """'auto' -> cuda, then mps, then cpu; any other name is used as given."""
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def pyplot():
    """matplotlib.pyplot with a file-only backend, or None (and a message) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figures (pip install matplotlib)")
        return None
    return plt
