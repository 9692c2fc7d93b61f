"""Entry point for the PyInstaller build (the console script `localllm` is not a file PyInstaller can use)."""

from localllm.cli import main

if __name__ == "__main__":
    main()
