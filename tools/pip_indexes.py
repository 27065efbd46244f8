"""Print, as uv command-line options, the package indexes pip is configured with here (`pip config list`: files and
environment variables), so that `make venv` installs with uv from exactly where pip would. uv reads no pip
configuration of its own; a machine with none prints nothing and uv uses PyPI, as pip would."""
import shlex, subprocess, sys

OPTIONS = ("index-url", "extra-index-url", "find-links")   # where packages come from; the rest of pip's settings is pip's


def uv_options(config: str) -> list[str]:
    "uv's options for the indexes in `pip config list`'s output (`section.key='value'` lines; a list value is space-separated)."
    seen, args = set(), []
    for line in config.splitlines():
        key, _, value = line.partition("=")
        option = key.rsplit(".", 1)[-1]
        if option not in OPTIONS: continue
        for v in shlex.split(value.strip().strip("'\"")):
            if (option, v) not in seen: seen.add((option, v)); args += [f"--{option}", v]
    return args


if __name__ == "__main__":
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    print(shlex.join(uv_options(out)))
