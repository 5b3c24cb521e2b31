"""A worker whose main is decorated with torch's real @record and raises."""

import os

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    raise ValueError(f"boom from rank {os.environ['RANK']}")


if __name__ == "__main__":
    main()
