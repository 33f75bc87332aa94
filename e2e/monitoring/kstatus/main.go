// Command kstatus prints what sigs.k8s.io/cli-utils' kstatus (the library Flux's
// kustomize-controller uses for health checks) computes for one object.
//
// Usage: kstatus < object.json   ->   {"status":"Current","message":"..."}
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

func main() {
	raw, err := io.ReadAll(io.LimitReader(os.Stdin, 4<<20))
	if err != nil {
		fail(err)
	}
	obj := &unstructured.Unstructured{}
	// Numbers as int64 where they are whole, as the API machinery reads objects.
	if err := utiljson.Unmarshal(raw, &obj.Object); err != nil {
		fail(fmt.Errorf("stdin is not one JSON object: %w", err))
	}
	res, err := status.Compute(obj)
	if err != nil {
		fail(err)
	}
	out, _ := json.Marshal(map[string]string{"status": res.Status.String(), "message": res.Message})
	fmt.Println(string(out))
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "kstatus:", err)
	os.Exit(1)
}
