"""The tenant API: base view, fields, filters, renderers, serializers, views, catalog."""
