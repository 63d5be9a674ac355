"""Train, validate, test or predict: ``python cli.py fit [--config configs/mnist.yaml] [--config ...]``."""

from app.cli import main

if __name__ == "__main__":
    main()
