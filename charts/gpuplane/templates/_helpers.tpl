{{/* The chart name, and the prefix of every resource name. */}}
{{- define "gpuplane.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpuplane.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "gpuplane.cluster" -}}
{{- if eq .Values.mode "cluster" }}true{{ else if eq .Values.mode "standalone" }}{{ else }}{{ fail (printf "mode must be cluster or standalone, not %q" .Values.mode) }}{{ end -}}
{{- end -}}

{{/* Labels of every object; "component" adds app.kubernetes.io/component. */}}
{{- define "gpuplane.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: gpuplane
{{ include "gpuplane.selectorLabels" . }}
{{- end -}}

{{- define "gpuplane.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuplane.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- with (get . "component") }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end -}}

{{- define "gpuplane.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The Secrets every process reads, as container env entries. */}}
{{- define "gpuplane.secretEnv" -}}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef: {name: {{ .Values.secrets.database.existingSecret }}, key: {{ .Values.secrets.database.key }}}
- name: CELERY_BROKER_URL
  valueFrom:
    secretKeyRef: {name: {{ .Values.secrets.broker.existingSecret }}, key: {{ .Values.secrets.broker.key }}}
- name: DJANGO_SECRET_KEY
  valueFrom:
    secretKeyRef: {name: {{ .Values.secrets.secretKey.existingSecret }}, key: {{ .Values.secrets.secretKey.key }}}
{{- end -}}

{{- define "gpuplane.envFrom" -}}
envFrom:
  - configMapRef:
      name: {{ include "gpuplane.fullname" . }}-settings
{{- end -}}

{{- define "gpuplane.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: [ALL]
{{- end -}}

{{- define "gpuplane.scratchMounts" -}}
- name: var
  mountPath: /var/lib/gpuplane
- name: tmp
  mountPath: /tmp
{{- end -}}

{{- define "gpuplane.scratchVolumes" -}}
- name: var
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- end -}}

{{/* Pod-level security; "fsGroup" adds the group that makes mounted Secrets readable. */}}
{{- define "gpuplane.podSecurity" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  {{- if (get . "fsGroup") }}
  # The Secret's files are root-owned: the group makes them readable by the server.
  fsGroup: 10001
  {{- end }}
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{/* Waits (by failing and being restarted) until the beat pod has applied the migrations. */}}
{{- define "gpuplane.waitForMigrations" -}}
# Waits (by failing and being restarted) until the gpuplane-beat pod has applied the
# migrations this image needs.
- name: wait-for-migrations
  image: {{ include "gpuplane.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["python", "manage.py", "migrate", "--check"]
  {{- include "gpuplane.envFrom" . | nindent 2 }}
  env:
    {{- include "gpuplane.secretEnv" . | nindent 4 }}
  {{- include "gpuplane.containerSecurity" . | nindent 2 }}
  volumeMounts:
    {{- include "gpuplane.scratchMounts" . | nindent 4 }}
{{- end -}}

{{/* nodeSelector, tolerations, affinity and pull secrets of a component's pods:
     .root, .values (the component's values), .component, .spread (default anti-affinity). */}}
{{- define "gpuplane.scheduling" -}}
{{- $root := .root -}}
{{- with (.values.nodeSelector | default $root.Values.nodeSelector) }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (.values.tolerations | default $root.Values.tolerations) }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $affinity := .values.affinity | default $root.Values.affinity -}}
{{- if $affinity }}
affinity:
  {{- toYaml $affinity | nindent 2 }}
{{- else if (get . "spread") }}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "gpuplane.selectorLabels" (dict "root" $root "component" .component) | nindent 14 }}
{{- end }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "gpuplane.podAnnotations" -}}
annotations:
  # Changing a setting rolls the pods.
  checksum/settings: {{ include (print .Template.BasePath "/settings.yaml") . | sha256sum }}
  {{- with .Values.podAnnotations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{- define "gpuplane.allowedHosts" -}}
{{- $ns := .Release.Namespace -}}
{{- $full := include "gpuplane.fullname" . -}}
{{- $hosts := list -}}
{{- if include "gpuplane.cluster" . -}}
{{- $hosts = append $hosts (printf "%s-webhook.%s.svc" $full $ns) -}}
{{- $hosts = append $hosts (printf "%s-webhook.%s.svc.cluster.local" $full $ns) -}}
{{- end -}}
{{- $hosts = append $hosts (printf "%s-api.%s.svc" $full $ns) -}}
{{- $hosts = append $hosts (printf "%s-api.%s.svc.cluster.local" $full $ns) -}}
{{- $hosts = append $hosts "localhost" -}}
{{- $hosts = concat $hosts .Values.allowedHosts -}}
{{- join "," $hosts -}}
{{- end -}}

{{- define "gpuplane.runbook" -}}
{{- if .base -}}
runbook_url: {{ printf "%s#%s" .base .anchor | quote }}
{{- else -}}
runbook: {{ printf "docs/operations.md#%s" .anchor | quote }}
{{- end -}}
{{- end -}}
