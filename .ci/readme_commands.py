"""Print the shell commands of the README's "Two commands" section, NUL-separated.

Each is the text of a ```bash block in that section, in order (examples
there that CI does not run are fenced as ```shell).
"""

import re
import sys


def readme_commands(text: str) -> list[str]:
    section = re.search(r"^## Two commands\n(.*?)(?=^## )", text, flags=re.M | re.S)
    if section is None:
        raise SystemExit("readme_commands: no '## Two commands' section in the README")
    blocks = re.findall(r"^```bash\n(.*?)^```", section.group(1), flags=re.M | re.S)
    return [block.strip() for block in blocks]


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as readme:
        sys.stdout.write("".join(command + "\0" for command in readme_commands(readme.read())))
