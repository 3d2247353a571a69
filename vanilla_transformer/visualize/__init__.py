"""Looking inside a model: attention heat maps, the explorer page and the web app."""
