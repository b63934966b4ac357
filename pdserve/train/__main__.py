"""`python -m pdserve.train --out DIR [...]`: train the built-in pair and print its metrics."""

from pdserve.train.main import main

if __name__ == "__main__":
    main()
