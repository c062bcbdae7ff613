// Removes static members (group.instance.id) from a consumer group: Kafka's Admin
// removeMembersFromConsumerGroup (KIP-345), which librdkafka does not offer. A static member that
// stops does not leave its group (its partitions wait for its session to expire); removing it
// rebalances them at once. Run as a single-file program with the broker's jars:
//   java -cp "<kafka lib>/*" RemoveStaticMembers.java <client.properties> <group> <instance-id>...
// Prints one line per member: "removed <id>" or "kept <id>: <why>"; exit 1 if any was kept.
import java.io.FileInputStream;
import java.util.ArrayList;
import java.util.List;
import java.util.Properties;
import java.util.concurrent.TimeUnit;

import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.MemberToRemove;
import org.apache.kafka.clients.admin.RemoveMembersFromConsumerGroupOptions;
import org.apache.kafka.clients.admin.RemoveMembersFromConsumerGroupResult;

public class RemoveStaticMembers {
    public static void main(String[] args) throws Exception {
        Properties props = new Properties();
        try (FileInputStream in = new FileInputStream(args[0])) {
            props.load(in);
        }
        List<MemberToRemove> members = new ArrayList<>();
        for (int i = 2; i < args.length; i++) {
            members.add(new MemberToRemove(args[i]));
        }
        boolean ok = true;
        try (Admin admin = Admin.create(props)) {
            RemoveMembersFromConsumerGroupResult result =
                admin.removeMembersFromConsumerGroup(args[1], new RemoveMembersFromConsumerGroupOptions(members));
            for (MemberToRemove member : members) {
                try {
                    result.memberResult(member).get(30, TimeUnit.SECONDS);
                    System.out.println("removed " + member.groupInstanceId());
                } catch (Exception e) {
                    ok = false;
                    Throwable cause = e.getCause() != null ? e.getCause() : e;
                    System.out.println("kept " + member.groupInstanceId() + ": " + cause.getMessage());
                }
            }
        }
        System.exit(ok ? 0 : 1);
    }
}
