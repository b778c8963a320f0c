{{/*
Pod template of a trainer node, shared by the StatefulSets and the LeaderWorkerSet.
Called with (dict "root" $ "role" "head"|"worker").

Each pod runs torchrun with one rank per GPU. The node rank comes from the pod itself: 0 for the head,
the StatefulSet pod-index label for workers (their StatefulSet starts its ordinals at 1, so the pod
index is the node rank), LWS_WORKER_INDEX under a LeaderWorkerSet. Only the head pod (node rank 0,
whose local rank 0 is global rank 0 and serves gRPC) runs the refit sidecar, has the gRPC ports and
probes, and is selected by the trainer and sidecar Services. Every rank reaches the sidecar through the
rank-0 pod's own DNS name (the torchrun master address), which resolves before the pod is ready;
on the head node that is the pod's own address.
*/}}
{{- define "trainer-refit.trainerPodTemplate" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $t := $v.trainer }}
{{- $head := eq .role "head" }}
{{- $lws := $t.leaderWorkerSet.enabled }}
{{- $allRanks := include "trainer-refit.trainerSelectorLabels" (dict "root" $root "role" "") | fromYaml -}}
metadata:
  labels:
    {{- include "trainer-refit.trainerLabels" (dict "root" $root "role" .role) | nindent 4 }}
    {{- with $t.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    {{- include "trainer-refit.configChecksum" $root | nindent 4 }}
    {{- with $t.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- with (include "trainer-refit.podCommon" $root | trim) }}{{ . | nindent 2 }}{{ end }}
  {{- with (include "trainer-refit.scheduling" (dict "root" $root "component" $t "antiAffinity" (ternary $allRanks dict $t.oneNodePerPod)) | trim) }}{{ . | nindent 2 }}{{ end }}
  terminationGracePeriodSeconds: {{ $t.terminationGracePeriodSeconds | int }}
  {{- if and $head $v.sidecar.enabled }}
  initContainers:
    # Native sidecar: starts before the trainer (once its startup probe passes), runs for the pod's
    # lifetime and shares the pod's network and IPC namespaces and /dev/shm with the ranks.
    - name: refit-sidecar
      image: {{ include "trainer-refit.image" (dict "root" $root "override" $v.sidecar.image) }}
      imagePullPolicy: {{ include "trainer-refit.imagePullPolicy" (dict "root" $root "override" $v.sidecar.image) }}
      restartPolicy: Always
      command: ["refit-sidecar"]
      args:
        - --host=0.0.0.0
        - --port={{ $v.sidecar.port | int }}
        {{- include "trainer-refit.sidecarAuthArgs" $root | nindent 8 }}
        {{- range $v.sidecar.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      {{- with (concat ($v.env | default list) ($v.sidecar.env | default list)) }}
      env:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- include "trainer-refit.envFrom" $root | nindent 6 }}
      ports:
        - name: sidecar-grpc
          containerPort: {{ $v.sidecar.port | int }}
          protocol: TCP
      {{- include "trainer-refit.grpcProbes" (dict "port" $v.sidecar.port "probes" $v.sidecar.probes "tls" $v.auth.tls.secretName) | nindent 6 }}
      {{- with $v.sidecar.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (include "trainer-refit.securityContext" (dict "root" $root "rdma" false) | trim) }}{{ . | nindent 6 }}{{ end }}
      volumeMounts:
        - name: dshm
          mountPath: /dev/shm
        {{- with (include "trainer-refit.secretMounts" (dict "root" $root "name" "sidecar-secrets") | trim) }}{{ . | nindent 8 }}{{ end }}
  {{- end }}
  containers:
    - name: trainer
      image: {{ include "trainer-refit.image" (dict "root" $root "override" $t.image) }}
      imagePullPolicy: {{ include "trainer-refit.imagePullPolicy" (dict "root" $root "override" $t.image) }}
      command: ["torchrun"]
      args:
        - --nnodes=$(NNODES)
        - --nproc-per-node=$(GPUS_PER_NODE)
        - --node-rank=$(NODE_RANK)
        - --rdzv-backend=static
        - --master-addr={{ include "trainer-refit.masterAddr" $root }}
        - --master-port={{ $t.rendezvousPort | int }}
        - -m
        - trainer_svc
        - --model=$(MODEL_PATH)
        - --params-dtype=$(PARAMS_DTYPE)
        - --vocab-multiple=$(VOCAB_MULTIPLE)
        {{- if not (kindIs "invalid" $v.model.maxSeqLen) }}
        - --max-seq-len=$(MAX_SEQ_LEN)
        {{- end }}
        - --tp=$(TP_SIZE)
        - --pp=$(PP_SIZE)
        - --dp=$(DP_SIZE)
        - --device={{ $t.device }}
        - --optimizer={{ $t.optimizer.kind }}
        - --lr={{ $t.optimizer.lr | float64 }}
        - --weight-decay={{ $t.optimizer.weightDecay | float64 }}
        - --max-grad-norm={{ $t.optimizer.maxGradNorm | float64 }}
        - --update-kernels={{ $t.optimizer.updateKernels }}
        - --host=0.0.0.0
        - --port={{ $t.port | int }}
        - --max-microbatch-tokens={{ $t.maxMicrobatchTokens | int }}
        {{- if not (kindIs "invalid" $t.passTokenBudget) }}
        - --pass-token-budget={{ $t.passTokenBudget | int }}
        {{- end }}
        - --attention={{ $t.attention }}
        - --recompute={{ $t.recompute }}
        - --cuda-graphs={{ $t.cudaGraphs }}
        {{- if $t.deterministic }}
        - --deterministic
        {{- end }}
        - --sequence-layout={{ $t.sequenceLayout }}
        - --packed-attention={{ $t.packedAttention }}
        - --reference-policy={{ $t.referencePolicy }}
        - --reference-placement={{ $t.referencePlacement }}
        - --seed={{ $t.seed | int }}
        - --log-level={{ $t.logLevel }}
        {{- if $v.sidecar.enabled }}
        - --sidecar={{ include "trainer-refit.masterAddr" $root }}:{{ $v.sidecar.port | int }}
        {{- if $t.publishStart }}
        - --refit-publish-start
        {{- end }}
        {{- end }}
        {{- include "trainer-refit.trainerAuthArgs" $root | nindent 8 }}
        {{- include "trainer-refit.trainerPlacementArgs" $root | nindent 8 }}
        {{- range $t.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        - name: NODE_RANK
          {{- if $lws }}
          value: $(LWS_WORKER_INDEX)
          {{- else if $head }}
          value: "0"
          {{- else }}
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
          {{- end }}
        # The address the rank's NIXL endpoints listen on (--nixl-host).
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        {{- with (include "trainer-refit.rdmaEnv" $root | trim) }}{{ . | nindent 8 }}{{ end }}
        {{- include "trainer-refit.nixlEnv" $root | nindent 8 }}
        {{- with (concat ($v.env | default list) ($t.env | default list)) }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- include "trainer-refit.envFrom" $root | nindent 6 }}
      {{- if $head }}
      ports:
        - name: grpc
          containerPort: {{ $t.port | int }}
          protocol: TCP
        - name: rendezvous
          containerPort: {{ $t.rendezvousPort | int }}
          protocol: TCP
      {{- include "trainer-refit.grpcProbes" (dict "port" $t.port "probes" $t.probes "tls" $v.auth.tls.secretName) | nindent 6 }}
      {{- end }}
      resources:
        {{- include "trainer-refit.resources" (dict "resources" $t.resources "extra" (include "trainer-refit.acceleratorResources" (dict "root" $root "gpus" $t.gpusPerNode) | fromYaml)) | nindent 8 }}
      {{- with (include "trainer-refit.securityContext" (dict "root" $root "rdma" true) | trim) }}{{ . | nindent 6 }}{{ end }}
      volumeMounts:
        - name: dshm
          mountPath: /dev/shm
        {{- if $v.checkpoints.enabled }}
        - name: checkpoints
          mountPath: {{ $v.checkpoints.mountPath }}
        {{- end }}
        {{- with (include "trainer-refit.secretMounts" (dict "root" $root "name" "trainer-secrets") | trim) }}{{ . | nindent 8 }}{{ end }}
        {{- with $t.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    {{- include "trainer-refit.shmVolume" (dict "sizeLimit" $t.shmSizeLimit) | nindent 4 }}
    {{- if $v.checkpoints.enabled }}
    {{- include "trainer-refit.checkpointVolume" $root | nindent 4 }}
    {{- end }}
    {{- with (include "trainer-refit.secretVolumes" (dict "root" $root "name" "trainer-secrets" "roles" (list "orchestrator" "trainer")) | trim) }}{{ . | nindent 4 }}{{ end }}
    {{- if and $head $v.sidecar.enabled }}
    {{- with (include "trainer-refit.secretVolumes" (dict "root" $root "name" "sidecar-secrets" "roles" (list "trainer" "receiver")) | trim) }}{{ . | nindent 4 }}{{ end }}
    {{- end }}
    {{- with $t.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
