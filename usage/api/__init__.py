"""The tenant API (SPEC §8): base view, fields, filters, renderers, serializers, views, catalog."""
