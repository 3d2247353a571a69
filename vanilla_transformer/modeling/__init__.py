"""The model's code: the files copied into every saved model folder and loaded from it with
`trust_remote_code=True`. They import one another relatively and nothing else of this package."""
