{{- define "compilecast.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "compilecast.fullname" -}}
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

{{/* Stable selector labels: never change them between releases. */}}
{{- define "compilecast.selectorLabels" -}}
app.kubernetes.io/name: {{ include "compilecast.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "compilecast.labels" -}}
{{ include "compilecast.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end -}}

{{- define "compilecast.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "compilecast.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- $full := include "compilecast.fullname" . -}}
{{- $eps := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $eps = append $eps (printf "%s-etcd-%d.%s-etcd-headless:2379" $full $i $full) -}}
{{- end -}}
{{- join "," $eps -}}
{{- else -}}
{{- join "," .Values.etcd.externalEndpoints -}}
{{- end -}}
{{- end -}}

{{/* Refuse value combinations that cannot work. */}}
{{- define "compilecast.validate" -}}
{{- if and (not .Values.etcd.enabled) (empty .Values.etcd.externalEndpoints) -}}
{{- fail "etcd.enabled is false: set etcd.externalEndpoints to your etcd cluster (host:port list)" -}}
{{- end -}}
{{- if and .Values.etcd.enabled (eq (mod (int .Values.etcd.replicas) 2) 0) -}}
{{- fail "etcd.replicas must be odd (1, 3, 5) to keep a quorum" -}}
{{- end -}}
{{- if and (not .Values.auth.allowUnauthenticated) (not .Values.auth.tokensSecret) -}}
{{- fail "set auth.tokensSecret (a Secret with tokens.yaml), or auth.allowUnauthenticated=true explicitly" -}}
{{- end -}}
{{- if and .Values.tls.requireClientCerts (not .Values.tls.secretName) -}}
{{- fail "tls.requireClientCerts needs tls.secretName" -}}
{{- end -}}
{{- if not (has .Values.store.type (list "disk" "s3")) -}}
{{- fail (printf "store.type must be disk or s3, not %q" .Values.store.type) -}}
{{- end -}}
{{- if and (eq .Values.store.type "s3") (not .Values.store.s3.bucket) -}}
{{- fail "store.type s3 needs store.s3.bucket" -}}
{{- end -}}
{{- if and (eq .Values.store.type "s3") (not .Values.store.s3.cacheMaxBytes) -}}
{{- fail "store.type s3 needs store.s3.cacheMaxBytes (each replica's local cache, below store.s3.cacheSize)" -}}
{{- end -}}
{{- if and (eq .Values.store.type "disk") (gt (int .Values.coordinator.replicas) 1) (not .Values.coordinator.storage.existingClaim) (not (has "ReadWriteMany" .Values.coordinator.storage.accessModes)) -}}
{{- fail "coordinator.replicas > 1 needs a shared artifact store: accessModes [ReadWriteMany], an existingClaim, or store.type s3" -}}
{{- end -}}
{{- end -}}
