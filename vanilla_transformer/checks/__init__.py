"""What the package checks before it trusts what it is handed, a module each: the values of options and their bounds
(bounds.py), the files it reads (files.py: JSON, text, weights, pickles, paths inside a folder), the fields of a model folder's
JSON files with their bounds (folder_fields.py), a LoRA adapter saved in a folder (adapters.py). Each refuses in a
`BadInput` (errors.py, beside this package). model_folder.py is the gate that runs them all on a model folder before
anything is built from it, then loads it: what every command that reads a folder goes through."""
