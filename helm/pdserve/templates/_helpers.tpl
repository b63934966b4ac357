{{/* Names, labels and the pieces the router and both node groups share. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped base name; the group suffixes (-router, -prefill, -decode) must still fit 63. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end -}}

{{/* Selector labels of one component; call with (dict "root" $ "component" "router"). */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.componentLabels" -}}
{{ include "pdserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The headless service of a node group, and its DNS name as the router resolves it. */}}
{{- define "pdserve.groupService" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root) .group -}}
{{- end -}}

{{- define "pdserve.groupFQDN" -}}
{{- printf "%s.%s.svc.%s" (include "pdserve.groupService" .) .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* The model volume (none for the images' built-in pair). */}}
{{- define "pdserve.modelVolume" -}}
{{- $src := .Values.model.source -}}
{{- if eq $src.type "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.source.pvc.claimName is required for a pvc model source" $src.pvc.claimName }}
    readOnly: {{ $src.pvc.readOnly }}
{{- else if eq $src.type "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.source.hostPath.path is required for a hostPath model source" $src.hostPath.path }}
    type: {{ $src.hostPath.type }}
{{- else if eq $src.type "image" }}
- name: model
  image:
    reference: {{ required "model.source.image.reference is required for an image model source" $src.image.reference }}
    pullPolicy: {{ $src.image.pullPolicy }}
{{- end }}
{{- end -}}

{{- define "pdserve.modelMount" -}}
{{- if ne .Values.model.source.type "builtin" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* Drop every capability; IPC_LOCK comes back only where RDMA registers (pins) memory. */}}
{{- define "pdserve.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
  {{- if .ipcLock }}
  add: ["IPC_LOCK"]
  {{- end }}
{{- end -}}

{{/* A pod's resources: one GPU per tensor-parallel rank (where the group asks for GPUs, or runs
several ranks on a device other than the CPU), and the RDMA device plugin's resources. */}}
{{- define "pdserve.nodeResources" -}}
{{- $res := deepCopy (default dict .group.resources) -}}
{{- $limits := deepCopy (default dict $res.limits) -}}
{{- if or (hasKey $limits "nvidia.com/gpu") (and (gt .tp 1) (ne .root.Values.node.device "cpu")) -}}
{{- $_ := set $limits "nvidia.com/gpu" .tp -}}
{{- end -}}
{{- if .root.Values.rdma.enabled -}}
{{- $limits = merge $limits .root.Values.rdma.resources -}}
{{- end -}}
{{- if $limits -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* A quantity such as 8Gi times the ranks of a pod (16Gi for two). */}}
{{- define "pdserve.timesRanks" -}}
{{- $q := toString .quantity -}}
{{- $n := regexFind "^[0-9]+" $q -}}
{{- printf "%d%s" (mul (atoi $n) .tp) (trimPrefix $n $q) -}}
{{- end -}}

{{/* The Secret holding the router's API keys: the user's, the chart's, or none. */}}
{{- define "pdserve.apiKeySecret" -}}
{{- if .Values.router.apiKeys.existingSecret -}}
{{- .Values.router.apiKeys.existingSecret -}}
{{- else if .Values.router.apiKeys.create -}}
{{- printf "%s-api-keys" (include "pdserve.fullname" .) -}}
{{- end -}}
{{- end -}}
