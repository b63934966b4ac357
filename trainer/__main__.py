"""`python -m trainer --out DIR [...]`: train the built-in pair and print its metrics."""

from trainer.main import main

if __name__ == "__main__":
    main()
