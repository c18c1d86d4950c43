"""Books GPU devices onto nodes: mirror models, the pure engine, passes and their tasks."""
