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

{{/* The container securityContext: the global `securityContext` under the component's
     (.root, .values). */}}
{{- define "gpuplane.containerSecurity" -}}
{{- $merged := mustMergeOverwrite (deepCopy (.root.Values.securityContext | default dict)) (deepCopy (.values.securityContext | default dict)) -}}
{{- with $merged -}}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "gpuplane.scratchMounts" -}}
- name: var
  mountPath: /var/lib/gpuplane
- name: tmp
  mountPath: /tmp
{{- end -}}

{{/* The scratch volumes and the extra ones (global, then the component's): .root, .values. */}}
{{- define "gpuplane.scratchVolumes" -}}
- name: var
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- with .root.Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- with .values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The extra environment and mounts of every gpuplane container: .root, .values. */}}
{{- define "gpuplane.extraEnv" -}}
{{- with .root.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- with .values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "gpuplane.extraMounts" -}}
{{- with .root.Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- with .values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod-level security: the global `podSecurityContext` under the component's (.root, .values).
     A key set to null in the global one is dropped (OpenShift assigns the IDs itself). */}}
{{- define "gpuplane.podSecurity" -}}
{{- $merged := mustMergeOverwrite (deepCopy (.root.Values.podSecurityContext | default dict)) (deepCopy (.values.podSecurityContext | default dict)) -}}
{{- with $merged }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Waits (by failing and being restarted) until the beat pod has applied the migrations: .root, .values. */}}
{{- define "gpuplane.waitForMigrations" -}}
{{- $root := .root -}}
# Waits (by failing and being restarted) until the gpuplane-beat pod has applied the
# migrations this image needs.
- name: wait-for-migrations
  image: {{ include "gpuplane.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command: ["python", "manage.py", "migrate", "--check"]
  {{- include "gpuplane.envFrom" $root | nindent 2 }}
  env:
    {{- include "gpuplane.secretEnv" $root | nindent 4 }}
    {{- with include "gpuplane.extraEnv" . | trim }}{{ . | nindent 4 }}{{ end }}
  {{- include "gpuplane.containerSecurity" . | nindent 2 }}
  volumeMounts:
    {{- include "gpuplane.scratchMounts" . | nindent 4 }}
    {{- with include "gpuplane.extraMounts" . | trim }}{{ . | nindent 4 }}{{ end }}
{{- end -}}

{{/* What every pod spec of a component shares: priority, securityContext, nodeSelector,
     tolerations, affinity, topology spread and pull secrets:
     .root, .values (the component's values), .component, .spread (default anti-affinity). */}}
{{- define "gpuplane.scheduling" -}}
{{- $root := .root -}}
{{- with (.values.priorityClassName | default $root.Values.priorityClassName) }}
priorityClassName: {{ . }}
{{- end }}
{{- include "gpuplane.podSecurity" . }}
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
{{- with (.values.topologySpreadConstraints | default $root.Values.topologySpreadConstraints) }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A component's pod labels: the chart's, the global `podLabels`, the component's: .root, .values, .component. */}}
{{- define "gpuplane.podLabels" -}}
{{ include "gpuplane.labels" (dict "root" .root "component" .component) }}
{{- with .root.Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- with .values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* A ServiceAccount's annotations: .values. */}}
{{- define "gpuplane.serviceAccountAnnotations" -}}
{{- with (.values.serviceAccount | default dict).annotations }}
annotations:
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
{{- if .Values.ingress.enabled }}{{ $hosts = concat $hosts .Values.ingress.hosts }}{{ end -}}
{{- $hosts = uniq $hosts -}}
{{- join "," $hosts -}}
{{- end -}}

{{- define "gpuplane.runbook" -}}
{{- if .base -}}
runbook_url: {{ printf "%s#%s" .base .anchor | quote }}
{{- else -}}
runbook: {{ printf "docs/operations.md#%s" .anchor | quote }}
{{- end -}}
{{- end -}}

{{/* "true" where a `true | false | auto` value says to render something that needs the API
     `.api` (auto: where the cluster serves it): .value, .api, .root. */}}
{{- define "gpuplane.wanted" -}}
{{- $mode := toString .value -}}
{{- if eq $mode "true" }}true{{ else if eq $mode "auto" }}{{ if .root.Capabilities.APIVersions.Has .api }}true{{ end }}{{ else if ne $mode "false" }}{{ fail (printf "%s must be auto, true or false, not %q" .name $mode) }}{{ end -}}
{{- end -}}

{{- define "gpuplane.serviceMonitor" -}}
{{- include "gpuplane.wanted" (dict "value" .Values.metrics.serviceMonitor.enabled "api" "monitoring.coreos.com/v1/ServiceMonitor" "root" . "name" "metrics.serviceMonitor.enabled") -}}
{{- end -}}

{{- define "gpuplane.prometheusRule" -}}
{{- include "gpuplane.wanted" (dict "value" .Values.metrics.prometheusRule.enabled "api" "monitoring.coreos.com/v1/PrometheusRule" "root" . "name" "metrics.prometheusRule.enabled") -}}
{{- end -}}

{{/* The webhook's `preStop`: keep serving while the endpoints drop the pod. */}}
{{- define "gpuplane.preStop" -}}
{{- if . -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ . }}"]
{{- end }}
{{- end -}}

{{/* The annotations of the certificate Job's hook objects, with their weight. */}}
{{- define "gpuplane.certificateHook" -}}
helm.sh/hook: pre-install,pre-upgrade,post-install,post-upgrade
helm.sh/hook-weight: {{ . | quote }}
helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
{{- end -}}

{{/* The annotations of the CRD upgrade's hook objects, with their weight. */}}
{{- define "gpuplane.crdHook" -}}
helm.sh/hook: pre-upgrade
helm.sh/hook-weight: {{ . | quote }}
helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
{{- end -}}

{{/* The Secret of the serving certificate: `secrets.webhookTLS.existingSecret`, else <prefix>-webhook-tls. */}}
{{- define "gpuplane.tlsSecret" -}}
{{- .Values.secrets.webhookTLS.existingSecret | default (printf "%s-webhook-tls" (include "gpuplane.fullname" .)) -}}
{{- end -}}
