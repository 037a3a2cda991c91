"""The repacked-weight cache (Orbax) and its Kaggle datasets."""
